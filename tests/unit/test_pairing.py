"""Pairing: replication_jump resolution and the pairing plan for several world sizes."""

from __future__ import annotations

import logging

import pytest

from lm_resiliency.errors import ConfigError, ReplicationError
from lm_resiliency.replication import pairing
from lm_resiliency.replication.pairing import PairingPlan, resolve_jump


@pytest.fixture(autouse=True)
def _fresh_log_once() -> None:
    # "Log once" is per process; each test must see its own lines.
    pairing._logged_once.clear()


def _no_gpu() -> int:
    return 0


def _resolve(jump: int, world: int, env: dict[str, str] | None = None, gpus: int = 0) -> int | None:
    return resolve_jump(jump, world, env=env or {}, gpu_count=lambda: gpus).jump


# --- resolve_jump ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "env", "gpus", "expected_jump", "source", "within_node"),
    [
        # torchrun-style launch: LOCAL_WORLD_SIZE is the node width.
        (16, {"LOCAL_WORLD_SIZE": "8"}, 0, 8, "LOCAL_WORLD_SIZE", False),
        (8, {"LOCAL_WORLD_SIZE": "2"}, 0, 2, "LOCAL_WORLD_SIZE", False),
        (4, {"LOCAL_WORLD_SIZE": "2"}, 0, 2, "LOCAL_WORLD_SIZE", False),
        # LOCAL_WORLD_SIZE wins over the GPU count.
        (16, {"LOCAL_WORLD_SIZE": "4"}, 8, 4, "LOCAL_WORLD_SIZE", False),
        # Without a launcher: the visible GPU count.
        (16, {}, 8, 8, "cuda.device_count", False),
        # Whole job on one node: pair within the node, half the world apart.
        (8, {"LOCAL_WORLD_SIZE": "8"}, 0, 4, "LOCAL_WORLD_SIZE", True),
        (2, {"LOCAL_WORLD_SIZE": "2"}, 0, 1, "LOCAL_WORLD_SIZE", True),
        (4, {}, 8, 2, "cuda.device_count", True),
        (6, {"LOCAL_WORLD_SIZE": "6"}, 0, 3, "LOCAL_WORLD_SIZE", True),
        # Nothing known: 1 (with a warning).
        (4, {}, 0, 1, "fallback", False),
    ],
)
def test_auto_jump_resolution(
    world: int, env: dict[str, str], gpus: int, expected_jump: int, source: str, within_node: bool
) -> None:
    decision = resolve_jump(-1, world, env=env, gpu_count=lambda: gpus)
    assert decision.jump == expected_jump
    assert decision.source == source
    assert decision.within_node is within_node
    plan = PairingPlan.build(world, decision.jump)
    assert plan.jump == expected_jump


def test_single_node_pairing_is_logged_once_as_process_loss_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=pairing.__name__)
    for _ in range(3):
        resolve_jump(-1, 8, env={"LOCAL_WORLD_SIZE": "8"}, gpu_count=_no_gpu)
    lines = [r.getMessage() for r in caplog.records if "one node" in r.getMessage()]
    assert len(lines) == 1
    assert "process loss, not a node loss" in lines[0]
    assert "jump 4" in lines[0]


def test_unknown_node_width_warns_that_pairs_may_share_a_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=pairing.__name__)
    assert _resolve(-1, 4) == 1
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "may share a node" in record.getMessage()
    assert "set replication_jump" in record.getMessage()


def test_explicit_jump_is_used_as_given() -> None:
    decision = resolve_jump(8, 16, env={"LOCAL_WORLD_SIZE": "8"}, gpu_count=_no_gpu)
    assert (decision.jump, decision.source, decision.within_node) == (8, "explicit", False)


def test_explicit_jump_inside_a_node_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=pairing.__name__)
    assert _resolve(2, 16, {"LOCAL_WORLD_SIZE": "8"}) == 2
    [record] = caplog.records
    assert "not a multiple of LOCAL_WORLD_SIZE=8" in record.getMessage()


@pytest.mark.parametrize(
    ("jump", "world", "env", "message"),
    [
        (3, 8, {}, "replication_jump=3 does not divide world_size=8; use a divisor of 8 such as 4"),
        (
            5,
            12,
            {},
            "replication_jump=5 does not divide world_size=12; use a divisor of 12 such as 6",
        ),
        (
            8,
            8,
            {},
            "replication_jump=8 must be smaller than world_size=8 (a rank cannot hold its own "
            "replica); use a divisor of 8 such as 4",
        ),
        (
            0,
            8,
            {},
            "replication_jump=0 is invalid: use -1 (one node width) or a positive divisor of "
            "world_size=8 smaller than 8, such as 4",
        ),
        (
            -2,
            9,
            {},
            "replication_jump=-2 is invalid: use -1 (one node width) or a positive divisor of "
            "world_size=9 smaller than 9, such as 3",
        ),
        (
            -1,
            8,
            {"LOCAL_WORLD_SIZE": "3"},
            "replication_jump=-1 (resolved to LOCAL_WORLD_SIZE=3) does not divide world_size=8; "
            "use a divisor of 8 such as 4",
        ),
        (
            -1,
            8,
            {"LOCAL_WORLD_SIZE": "zero"},
            "LOCAL_WORLD_SIZE='zero' is not a positive integer; fix the launcher environment or "
            "set replication_jump explicitly",
        ),
    ],
)
def test_invalid_jumps_name_the_value_and_a_fix(
    jump: int, world: int, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_jump(jump, world, env=env, gpu_count=_no_gpu)
    assert str(info.value) == message


def test_non_integer_jump_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"replication_jump='4' must be an integer"):
        resolve_jump("4", 8, env={}, gpu_count=_no_gpu)  # type: ignore[arg-type]


# --- PairingPlan -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "jump", "table", "symmetric"),
    [
        (2, 1, [(0, 1), (1, 0)], True),
        (4, 2, [(0, 2), (1, 3), (2, 0), (3, 1)], True),
        (4, 1, [(0, 1), (1, 2), (2, 3), (3, 0)], False),
        (8, 4, [(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3)], True),
        (8, 2, [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7), (6, 0), (7, 1)], False),
        (16, 8, [(r, (r + 8) % 16) for r in range(16)], True),
        (16, 4, [(r, (r + 4) % 16) for r in range(16)], False),
    ],
)
def test_plan_tables(world: int, jump: int, table: list[tuple[int, int]], symmetric: bool) -> None:
    plan = PairingPlan.build(world, jump)
    assert plan.table() == table
    assert plan.symmetric is symmetric
    assert plan.has_peer
    for src, dst in table:
        assert plan.send_to(src) == dst
        assert plan.recv_from(dst) == src
    # Every rank holds exactly one replica and has exactly one holder.
    assert sorted(d for _, d in table) == list(range(world))


def test_contract_example_world_16_jump_8() -> None:
    plan = PairingPlan.build(16, 8)
    assert [(r, plan.send_to(r)) for r in (0, 1, 7)] == [(0, 8), (1, 9), (7, 15)]
    assert plan.recv_from(0) == 8


def test_plan_json_lists_every_edge() -> None:
    plan = PairingPlan.build(4, 1)
    assert plan.to_json() == {
        "world_size": 4,
        "jump": 1,
        "symmetric": False,
        "pairs": [[0, 1], [1, 2], [2, 3], [3, 0]],
    }
    assert plan.describe() == "world_size=4 jump=1 (rings of 4): 0->1, 1->2, 2->3, 3->0"


def test_world_size_one_has_no_peer_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=pairing.__name__)
    for jump in (-1, 4):
        decision = resolve_jump(jump, 1, env={"LOCAL_WORLD_SIZE": "1"}, gpu_count=_no_gpu)
        assert decision.jump is None
        plan = PairingPlan.build(1, decision.jump)
        assert not plan.has_peer
        assert plan.table() == []
        assert plan.to_json() == {"world_size": 1, "jump": None, "symmetric": False, "pairs": []}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("world_size=1: no peer rank to replicate to")
    with pytest.raises(ReplicationError, match="rank 0 has no replication peer: world_size=1"):
        plan.send_to(0)


@pytest.mark.parametrize(
    ("world", "jump", "message"),
    [
        (8, 3, "replication_jump=3 does not divide world_size=8; use a divisor of 8 such as 4"),
        (8, None, "replication jump None must be an integer for world_size=8"),
        (4, 4, "replication_jump=4 must be smaller than world_size=4"),
    ],
)
def test_build_validates(world: int, jump: int | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        PairingPlan.build(world, jump)
    assert str(info.value).startswith(message)


def test_rank_outside_the_world_is_rejected() -> None:
    plan = PairingPlan.build(4, 2)
    with pytest.raises(ValueError, match="rank=4 is outside world_size=4"):
        plan.send_to(4)

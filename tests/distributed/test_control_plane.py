"""The control plane: bounded agreement collectives that name the rank that did not answer."""

from __future__ import annotations

import time

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.control import ControlPlane
from lm_resiliency.errors import CollectiveTimeout, ConfigError, RankFailures, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.knobs import MAX_WAIT_S
from lm_resiliency.testing import run_distributed

_TIMEOUT_S = 4.0


def _silent_rank(rank: int, world: int, tmp: str) -> dict:
    cfg = InMemoryCkptConfig(
        run_id="control", disk_folder=tmp, control_timeout_s=_TIMEOUT_S, signal_flush=False
    )
    m = InMemoryCheckpointManager(cfg)
    if rank == 2:
        time.sleep(4 * _TIMEOUT_S)  # does not answer the agreement in time
    t0 = time.monotonic()
    try:
        m.find_latest()
    except CollectiveTimeout as exc:
        return {"error": str(exc), "after_s": time.monotonic() - t0}
    return {"error": None, "after_s": time.monotonic() - t0}


def test_a_rank_that_does_not_answer_fails_every_other_rank_within_the_timeout(tmp_path) -> None:
    out = run_distributed(_silent_rank, 3, args=(str(tmp_path),), timeout_s=120)
    for rank in (0, 1):
        err = out[rank]["error"]
        assert err is not None, out[rank]
        assert "find_latest: gather availability" in err
        assert "rank(s) [2] never reached it" in err
        assert f"control_timeout_s={_TIMEOUT_S:g}" in err
        assert out[rank]["after_s"] < 3 * _TIMEOUT_S
    assert out[2]["error"] is not None  # its peers are gone by the time it asks


def _on_another_group(rank: int, world: int) -> int | None:
    # The manager's collectives never touch the caller's default group: a CPU-tensor
    # collective on it is not needed, so an NCCL default group works the same way.
    with InMemoryCheckpointManager(InMemoryCkptConfig(run_id="g", signal_flush=False)) as m:
        assert m.control.group is not None and m.control.world_size == world
        return m.find_latest()


def test_agreement_runs_on_a_private_gloo_group() -> None:
    assert run_distributed(_on_another_group, 2, timeout_s=60) == [None, None]


def _broken_twice(rank: int, world: int, tmp: str) -> dict | None:
    cfg = InMemoryCkptConfig(
        run_id="broken", disk_folder=tmp, control_timeout_s=2.0, signal_flush=False
    )
    m = InMemoryCheckpointManager(cfg)
    if rank == 1:
        return None  # leaves: rank 0's next agreement cannot complete
    errors = []
    for _ in range(2):
        try:
            m.find_latest()
        except CollectiveTimeout as exc:
            errors.append(str(exc))
    return {"errors": errors}


def test_a_broken_control_plane_fails_closed_afterwards(tmp_path) -> None:
    out = run_distributed(_broken_twice, 2, args=(str(tmp_path),), timeout_s=60)
    first, second = out[0]["errors"]
    assert "find_latest: gather availability" in first
    assert "failed earlier" in second and "restart the job" in second


def _one_bad_folder(rank: int, world: int, tmp: str) -> dict:
    t0 = time.monotonic()
    try:
        InMemoryCheckpointManager(
            InMemoryCkptConfig(run_id="bad", disk_folder=tmp, signal_flush=False)
        )
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc), "after_s": time.monotonic() - t0}
    return {"type": None}


def test_a_folder_refused_on_one_rank_fails_every_rank_at_once(tmp_path) -> None:
    bad = tmp_path / "bad-shm"
    bad.mkdir(mode=0o777)
    bad.chmod(0o777)  # others may write: refused
    env = {1: {"LM_RESILIENCY_MEMORY_FOLDER": str(bad)}}
    out = run_distributed(_one_bad_folder, 2, args=(str(tmp_path),), rank_env=env, timeout_s=60)
    for rank in (0, 1):  # the same error on every rank, naming rank 1 and its refusal
        assert out[rank]["type"] == "RankFailures", out[rank]
        assert "cannot open the memory folders on rank(s) [1]" in out[rank]["error"]
        assert "--- rank 1: UnsafePathError" in out[rank]["error"]
        assert "writable" in out[rank]["error"]
    assert out[0]["after_s"] < 10  # not a timeout: the refusal was agreed at once


def _enable_with_env(rank: int, world: int, tmp: str) -> dict:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A short agreement bound: a rank left waiting fails in seconds, not after 300 s.
    cfg = InMemoryCkptConfig(disk_folder=tmp, signal_flush=False, control_timeout_s=15)
    try:
        with enable_resiliency(model, opt, interval=1, config=cfg):
            return {"type": None}
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc)}


def test_a_bad_local_world_size_on_one_rank_is_the_named_error_on_every_rank(tmp_path) -> None:
    # Rank 1's launcher environment is broken; before, rank 0 waited in the topology
    # agreement and got a CollectiveTimeout that said nothing of LOCAL_WORLD_SIZE.
    env = {1: {"LOCAL_WORLD_SIZE": "0"}}
    out = run_distributed(_enable_with_env, 2, args=(str(tmp_path),), rank_env=env, timeout_s=90)
    named = "LOCAL_WORLD_SIZE='0' is not a positive integer; fix the launcher environment"
    assert out[1]["type"] == "ConfigError" and named in out[1]["error"], out[1]
    assert out[0]["type"] == "ConfigError", out[0]
    assert "cannot check this rank's environment on rank(s) [1]" in out[0]["error"]
    assert f"rank 1: ConfigError: {named}" in out[0]["error"]


def _longest_bounds(rank: int, world: int, tmp: str) -> int | None:
    # The largest accepted bounds must be usable by Gloo, timedelta and the threads' waits.
    cfg = InMemoryCkptConfig(
        run_id="longest",
        disk_folder=tmp,
        signal_flush=False,
        memory_folder=None,
        control_timeout_s=MAX_WAIT_S,
        replication_timeout_s=MAX_WAIT_S,
    )
    with InMemoryCheckpointManager(cfg) as m:
        m.save({"w": torch.full((4,), float(rank))}, 2)
        m.maybe_wait()
        return m.find_latest()


def test_the_largest_accepted_timeouts_work_with_real_gloo_ranks(tmp_path) -> None:
    assert run_distributed(_longest_bounds, 2, args=(str(tmp_path),), timeout_s=90) == [2, 2]


def _agree_on(rank: int, world: int, kind: str) -> dict:
    control = ControlPlane(None, timeout_s=30)

    def step() -> int:
        if kind == "raise" and rank == 2:
            raise UnsafePathError("the folder /x is a symlink", reason="symlink", path="/x")
        if kind == "config" and rank == 1:
            raise ConfigError("LM_X='-1' must be >= 0; fix the environment")
        if kind == "bug" and rank in (0, 2):
            raise KeyError(f"k{rank}")
        return rank * 10

    try:
        return {"result": control.agree(step, "check the thing")}
    except RankFailures as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return {"type": "RankFailures", "ranks": exc.ranks, "error": str(exc), "cause": cause,
                "types": {r: f.exc_type for r, f in exc.failures.items()}}  # fmt: skip
    except ConfigError as exc:
        inner = exc.__cause__
        ranks = inner.ranks if isinstance(inner, RankFailures) else None
        return {"type": "ConfigError", "error": str(exc), "ranks": ranks}
    finally:
        control.close()


def test_agree_returns_each_ranks_result_when_every_rank_succeeds() -> None:
    out = run_distributed(_agree_on, 3, args=("ok",), timeout_s=60)
    assert out == [{"result": 0}, {"result": 10}, {"result": 20}]


def test_agree_raises_rank_failures_naming_the_failed_rank_on_every_rank() -> None:
    out = run_distributed(_agree_on, 3, args=("raise",), timeout_s=60)
    for rank, got in enumerate(out):
        assert got["type"] == "RankFailures" and got["ranks"] == [2], got
        assert got["types"] == {2: "UnsafePathError"}
        assert "cannot check the thing on rank(s) [2]" in got["error"]
        assert "the folder /x is a symlink" in got["error"]
        assert "Traceback" in got["error"]  # the failing rank's traceback travels
        assert got["cause"] == ("UnsafePathError" if rank == 2 else None)


def test_agree_names_every_failed_rank_with_its_own_error() -> None:
    out = run_distributed(_agree_on, 3, args=("bug",), timeout_s=60)
    for got in out:
        assert got["type"] == "RankFailures" and got["ranks"] == [0, 2], got
        assert got["types"] == {0: "KeyError", 2: "KeyError"}
        assert "'k0'" in got["error"] and "'k2'" in got["error"]


def test_agree_a_config_error_on_one_rank_is_a_config_error_on_every_rank() -> None:
    out = run_distributed(_agree_on, 3, args=("config",), timeout_s=60)
    for got in out:
        assert got["type"] == "ConfigError" and got["ranks"] == [1], got
        assert "cannot check the thing on rank(s) [1]" in got["error"]
        assert "rank 1: ConfigError: LM_X='-1' must be >= 0; fix the environment" in got["error"]

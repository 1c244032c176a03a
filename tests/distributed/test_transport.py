"""ReplicationChannel over real Gloo ranks on loopback: bytes, headers, pairing, rejection."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ConfigError, ReplicationError
from lm_resiliency.replication import (
    PairingPlan,
    ReplicationChannel,
    check_header,
    make_header,
    resolve_jump,
)
from lm_resiliency.testing import run_distributed

RUN = "run-transport"
# A few MiB in 192 KiB chunks: many chunks in flight and a tail that is not a
# multiple of the chunk size.
CHUNK = 192 * 1024


def _state(owner: int, step: int) -> tuple[Layout, torch.Tensor]:
    """Owner- and step-specific tensors of mixed dtypes packed into one arena."""
    g = torch.Generator().manual_seed(1000 * owner + step)
    tensors = [
        torch.randn(300, 1000, generator=g),  # float32, 1.2 MB
        torch.randint(-(2**40), 2**40, (40_000,), generator=g, dtype=torch.int64),
        torch.randn(2049, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (777_777,), generator=g, dtype=torch.uint8),
    ]
    names = ["model.w", "opt.step_ids", "model.b", "sampler.bytes"]
    layout = Layout.from_tensors(tensors, names)
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for view, t in zip(layout.views(arena), tensors, strict=True):
        view.copy_(t)
    return layout, arena


def _doc(owner: int, step: int) -> dict[str, Any]:
    return {"owner": owner, "step": step, "lr": 0.5**owner, "data": {"epoch": 3, "pos": step}}


def _alloc(header: dict[str, Any]) -> torch.Tensor:
    return torch.zeros(header["total_bytes"], dtype=torch.uint8)


def _plan(rank: int, world: int, jump: int) -> PairingPlan:
    return PairingPlan.build(world, resolve_jump(jump, world).jump)


def _exchange_twice(rank: int, world: int, jump: int) -> dict[str, Any]:
    plan = _plan(rank, world, jump)
    channel = ReplicationChannel(plan, run_id=RUN, chunk_bytes=CHUNK, timeout_s=60)
    results = []
    for step in (10, 20):
        layout, arena = _state(rank, step)
        got = channel.exchange(
            step=step,
            send_header=make_header(RUN, rank, step, layout, _doc(rank, step)),
            send_arena=arena,
            recv_alloc=_alloc,
        )
        peer_layout, peer_arena = _state(plan.recv_from(rank), step)
        results.append(
            {
                "owner": got.owner_rank,
                "step": got.step,
                "doc": got.state_document,
                "digest_ok": got.layout.digest == peer_layout.digest,
                "bytes_equal": torch.equal(got.arena, peer_arena),
                "views_equal": all(
                    torch.equal(a, b)
                    for a, b in zip(
                        got.layout.views(got.arena), peer_layout.views(peer_arena), strict=True
                    )
                ),
            }
        )
    channel.close()
    return {"table": plan.table(), "results": results, "rebuilds": channel.rebuilds}


def _check_exchange(out: list[dict[str, Any]], plan: PairingPlan) -> None:
    for rank, rank_out in enumerate(out):
        assert rank_out["table"] == plan.table()
        assert rank_out["rebuilds"] == 0
        peer = plan.recv_from(rank)
        for step, res in zip((10, 20), rank_out["results"], strict=True):
            assert res == {
                "owner": peer,
                "step": step,
                "doc": _doc(peer, step),
                "digest_ok": True,
                "bytes_equal": True,
                "views_equal": True,
            }


def test_two_ranks_exchange_bit_identical_arenas_and_headers() -> None:
    out = run_distributed(_exchange_twice, 2, args=(-1,), timeout_s=180)
    _check_exchange(out, PairingPlan.build(2, 1))


def test_four_ranks_two_per_node_pair_across_nodes() -> None:
    # LOCAL_WORLD_SIZE=2 -> jump 2: 0<->2 and 1<->3, each pair spans both "nodes".
    out = run_distributed(_exchange_twice, 4, args=(-1,), ranks_per_node=2, timeout_s=240)
    plan = PairingPlan.build(4, 2)
    assert plan.table() == [(0, 2), (1, 3), (2, 0), (3, 1)]
    _check_exchange(out, plan)


def test_four_rank_ring_sends_and_receives_from_different_peers() -> None:
    out = run_distributed(_exchange_twice, 4, args=(1,), ranks_per_node=1, timeout_s=240)
    plan = PairingPlan.build(4, 1)
    assert plan.table() == [(0, 1), (1, 2), (2, 3), (3, 0)]
    _check_exchange(out, plan)


def _replica_goes_home(rank: int, world: int) -> bool:
    """After an exchange, each holder sends the replica back; the owner gets its own bytes."""
    plan = _plan(rank, world, 1)
    channel = ReplicationChannel(plan, run_id=RUN, chunk_bytes=CHUNK, timeout_s=60)
    layout, arena = _state(rank, 5)
    held = channel.exchange(
        step=5,
        send_header=make_header(RUN, rank, 5, layout, _doc(rank, 5)),
        send_arena=arena,
        recv_alloc=_alloc,
    )

    # Ring 0->1->2->3->0: rank r returns recv_from(r)'s replica; it receives its own
    # from send_to(r). Half the ranks send first so no cycle of blocking calls forms.
    def give_back() -> None:
        channel.send(
            held.owner_rank, step=5, header=held.header, arena=held.arena[: held.layout.total_bytes]
        )

    def fetch() -> Any:
        return channel.recv(channel.send_to, step=5, expect_owner=rank, recv_alloc=_alloc)

    if rank % 2 == 0:
        give_back()
        home = fetch()
    else:
        home = fetch()
        give_back()
    channel.close()
    return (
        home.owner_rank == rank
        and home.state_document == _doc(rank, 5)
        and torch.equal(home.arena, arena)
    )


def test_replica_returns_to_its_owner_with_send_and_recv() -> None:
    assert run_distributed(_replica_goes_home, 4, ranks_per_node=1, timeout_s=240) == [True] * 4


def _rejected(rank: int, world: int, case: str) -> dict[str, Any]:
    """Rank 0 sends a bad header to rank 1; rank 1 must refuse it before any arena byte."""
    plan = _plan(rank, world, -1)
    channel = ReplicationChannel(plan, run_id=RUN, chunk_bytes=CHUNK, timeout_s=60)
    layout, arena = _state(rank, 7)
    header = make_header(RUN, rank, 7, layout, _doc(rank, 7))
    if rank == 0:
        if case == "run_id":
            header = make_header("another-run", rank, 7, layout, _doc(rank, 7))
        elif case == "digest":
            header["layout_digest"] = "0" * 32
        elif case == "total_bytes":
            header["total_bytes"] = layout.total_bytes + 1
            arena = torch.zeros(layout.total_bytes + 1, dtype=torch.uint8)
        elif case == "tensor_table":
            header["layout"]["tensors"][0][3] = [1, 1]  # shape no longer matches the digest
        elif case == "trailer_bytes":
            header["trailer_bytes"] = -1
        elif case == "trailer_too_large":
            header["trailer_bytes"] = 1 << 40
    allocations: list[int] = []

    def alloc(h: dict[str, Any]) -> torch.Tensor:
        allocations.append(h["total_bytes"])
        if case == "alloc_fails" and rank == 1:
            raise MemoryError(f"no host memory for a {h['total_bytes']}-byte peer slot")
        return _alloc(h)

    def validate(h: dict[str, Any]) -> None:
        if case == "validator" and rank == 1:
            raise ReplicationError("state_document lacks 'sampler'")

    if case == "owner":
        # A header claiming another owner, sent point to point.
        if rank == 0:
            header["owner_rank"] = 1
            error = _error_of(lambda: channel.send(1, step=7, header=header, arena=arena))
        else:
            error = _error_of(lambda: channel.recv(0, step=7, expect_owner=0, recv_alloc=alloc))
    else:
        error = _error_of(
            lambda: channel.exchange(
                step=7, send_header=header, send_arena=arena, recv_alloc=alloc, validate=validate
            )
        )
    # The edge stays usable after a clean rejection: a good exchange follows.
    layout, arena = _state(rank, 8)
    got = channel.exchange(
        step=8,
        send_header=make_header(RUN, rank, 8, layout, _doc(rank, 8)),
        send_arena=arena,
        recv_alloc=_alloc,
    )
    ok = torch.equal(got.arena, _state(1 - rank, 8)[1])
    return {"error": error, "allocations": allocations, "next_ok": ok, "rebuilds": channel.rebuilds}


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except ReplicationError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("run_id", "header run_id 'another-run' does not match this run's 'run-transport'"),
        ("digest", "header layout_digest '00000000000000000000000000000000' does not match"),
        ("total_bytes", "header total_bytes"),
        ("tensor_table", "header layout is invalid: "),
        ("trailer_bytes", "header field trailer_bytes=-1 is not a byte count"),
        ("trailer_too_large", "a 1099511627776-byte trailer exceeds the limit"),
        ("owner", "header owner_rank 1 is not the expected owner 0"),
        ("validator", "ReplicationError: state_document lacks 'sampler'"),
        ("alloc_fails", "MemoryError: no host memory for a 2301875-byte peer slot"),
    ],
)
def test_bad_header_is_rejected_before_any_arena_byte(case: str, reason: str) -> None:
    sender, receiver = run_distributed(_rejected, 2, args=(case,), timeout_s=180)
    # The receiver refused before allocating, named itself, the peer, the step and why.
    attempted = [_state(0, 7)[0].total_bytes] if case == "alloc_fails" else []
    assert receiver["allocations"] == attempted
    assert receiver["error"] is not None
    assert "rank 1: validate header from peer 0 for step 7 failed" in receiver["error"]
    assert reason in receiver["error"]
    # The sender learned why its header was refused.
    assert sender["error"] is not None
    assert (
        "rank 0: replicate to peer 1 for step 7 failed: peer rejected the header" in sender["error"]
    )
    assert reason in sender["error"]
    # Nothing broke: no rebuild, and the next exchange moved the right bytes.
    assert sender["next_ok"] and receiver["next_ok"]
    assert sender["rebuilds"] == receiver["rebuilds"] == 0


def _skip(rank: int, world: int) -> dict[str, Any]:
    plan = _plan(rank, world, -1)
    channel = ReplicationChannel(plan, run_id=RUN, chunk_bytes=CHUNK, timeout_s=60)
    layout, arena = _state(rank, 3)
    header: dict[str, Any] | None = make_header(RUN, rank, 3, layout, _doc(rank, 3))
    send_arena: torch.Tensor | None = arena
    if rank == 1:
        header, send_arena = None, None
    error = _error_of(
        lambda: channel.exchange(
            step=3, send_header=header, send_arena=send_arena, recv_alloc=_alloc
        )
    )
    return {"error": error, "rebuilds": channel.rebuilds, "broken": channel.broken_edges}


def test_a_rank_with_nothing_to_send_fails_the_cycle_on_both_sides_without_waiting() -> None:
    r0, r1 = run_distributed(_skip, 2, timeout_s=120)
    assert "rank 0: replicate from peer 1 for step 3 failed: peer had no state" in r0["error"]
    assert "rank 1: replicate to peer 0 for step 3 failed: this rank had no state" in r1["error"]
    assert r0["broken"] == r1["broken"] == []


# --- without a process group -----------------------------------------------------


def test_no_channel_without_a_peer() -> None:
    with pytest.raises(
        ConfigError, match="world_size=1: no replication peer: nothing to replicate"
    ):
        ReplicationChannel(PairingPlan.build(1, None), run_id=RUN, rank=0)


def test_check_header_accepts_a_good_header_and_names_mismatches() -> None:
    layout, _ = _state(2, 4)
    header = make_header(RUN, 2, 4, layout, {"a": 1})
    assert check_header(header, run_id=RUN, owner_rank=2, step=4) == layout
    with pytest.raises(ReplicationError, match="header step 4 is not the expected step 5"):
        check_header(header, run_id=RUN, owner_rank=2, step=5)
    with pytest.raises(ReplicationError, match="header version 2 is not the supported 1"):
        check_header({**header, "version": 2}, run_id=RUN, owner_rank=2, step=4)
    with pytest.raises(ReplicationError, match="header lacks field"):
        check_header({"version": 1}, run_id=RUN, owner_rank=2, step=4)


def _bad_arguments(rank: int, world: int) -> list[str]:
    plan = _plan(rank, world, -1)
    channel = ReplicationChannel(plan, run_id=RUN, chunk_bytes=CHUNK, timeout_s=30)
    layout, arena = _state(rank, 1)
    header = make_header(RUN, rank, 1, layout, {})
    errors = []
    for kwargs in (
        {"send_header": header, "send_arena": None},
        {"send_header": header, "send_arena": arena[:-1]},
        {"send_header": make_header(RUN, rank, 2, layout, {}), "send_arena": arena},
    ):
        try:
            channel.exchange(step=1, recv_alloc=_alloc, **kwargs)
        except ValueError as exc:
            errors.append(str(exc).split(",")[0])
    dist.barrier()
    channel.close()
    return errors


def test_programmer_errors_raise_before_anything_is_sent() -> None:
    out = run_distributed(_bad_arguments, 2, timeout_s=120)
    total = _state(0, 1)[0].total_bytes
    assert out[0] == [
        "send_header and send_arena must both be given or both be None",
        f"arena must be a contiguous flat uint8 CPU tensor of the header's {total} bytes",
        "header is for owner 0 step 2",
    ]

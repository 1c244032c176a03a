"""Replication transport under faults: a peer killed mid-transfer, a peer that stalls.

The survivor must raise ReplicationError naming itself, the peer, the step and
the operation within its bounded wait; after a stall both endpoints rebuild the
broken edge and the next exchange moves the right bytes again.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ReplicationError
from lm_resiliency.replication import PairingPlan, ReplicationChannel, make_header
from lm_resiliency.testing import kill_point, run_distributed

RUN = "run-faults"
NBYTES = 8 * 1024 * 1024 + 4321
CHUNK = 256 * 1024
TIMEOUT_S = 5.0  # generous: the machine running the tests may be loaded


def _arena(owner: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * owner + step)
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g)


_LAYOUT = Layout.from_tensors([torch.empty(NBYTES, dtype=torch.uint8)], ["blob"])


def _alloc(header: dict[str, Any]) -> torch.Tensor:
    return torch.empty(header["total_bytes"], dtype=torch.uint8)


def _exchange(channel: ReplicationChannel, rank: int, step: int, **kwargs: Any) -> Any:
    kwargs.setdefault("recv_alloc", _alloc)
    return channel.exchange(
        step=step,
        send_header=make_header(RUN, rank, step, _LAYOUT, {"step": step}),
        send_arena=_arena(rank, step),
        **kwargs,
    )


def _killed_mid_transfer(rank: int, world: int, where: str) -> str | None:
    def progress(direction: str, done: int, total: int) -> None:
        if direction == where and 2 * done >= total:
            kill_point(f"replication-{where}-half")

    def alloc(header: dict[str, Any]) -> torch.Tensor:
        kill_point("replication-after-header")
        return _alloc(header)

    channel = ReplicationChannel(
        PairingPlan.build(2, 1),
        run_id=RUN,
        chunk_bytes=CHUNK,
        timeout_s=TIMEOUT_S * 10,  # death must be seen as a lost connection, not a timeout
        progress=progress,
    )
    try:
        _exchange(channel, rank, 10, recv_alloc=alloc)
    except ReplicationError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("where", "point", "operation"),
    [
        ("recv", "replication-recv-half", r"(send chunk \d+/33|receive ack)"),
        ("send", "replication-send-half", r"receive chunk \d+/33"),
        ("header", "replication-after-header", r"receive header verdict"),
    ],
)
def test_peer_killed_mid_transfer_is_reported_by_the_survivor(
    where: str, point: str, operation: str
) -> None:
    survivor, dead = run_distributed(
        _killed_mid_transfer, 2, args=(where,), kill={1: point}, timeout_s=120
    )
    assert dead is None
    assert survivor is not None
    assert survivor.startswith("replication exchange failed: rank 0: ")
    assert re.search(rf"rank 0: {operation} (to|from) peer 1 for step 10 failed", survivor)
    assert "connection lost" in survivor
    assert "edge 0->1 will be rebuilt" in survivor or "edge 1->0 will be rebuilt" in survivor


def _stall_then_recover(rank: int, world: int, where: str) -> dict[str, Any]:
    stalled = {"done": False}

    def stall() -> None:
        if rank == 1 and not stalled["done"]:
            stalled["done"] = True
            time.sleep(3 * TIMEOUT_S)

    def alloc(header: dict[str, Any]) -> torch.Tensor:
        if where == "alloc":
            stall()
        return _alloc(header)

    def progress(direction: str, done: int, total: int) -> None:
        if where == "mid-send" and direction == "send" and 2 * done >= total:
            stall()

    channel = ReplicationChannel(
        PairingPlan.build(2, 1),
        run_id=RUN,
        chunk_bytes=CHUNK,
        timeout_s=TIMEOUT_S,
        progress=progress,
    )
    error = None
    try:
        _exchange(channel, rank, 10, recv_alloc=alloc)
    except ReplicationError as exc:
        error = str(exc)
    broken = channel.broken_edges
    # Training's own collectives keep ranks within a step of each other; the next
    # replication cycle starts on both once the stalled rank has caught up.
    dist.barrier()
    got = _exchange(channel, rank, 20)
    return {
        "error": error,
        "broken_after_failure": broken,
        "next_equal": torch.equal(got.arena, _arena(1 - rank, 20)) and got.step == 20,
        "rebuilds": channel.rebuilds,
        "broken_now": channel.broken_edges,
    }


@pytest.mark.parametrize(
    ("where", "survivor_op", "stalled_op"),
    [
        # Rank 1 stalls after reading rank 0's header, before accepting it.
        ("alloc", "receive header verdict from peer 1", "send accept to peer 0"),
        # Rank 1 stalls halfway through sending its own arena.
        (
            "mid-send",
            r"receive chunk \d+/33 from peer 1",
            r"(send chunk \d+/33|receive ack) to peer 0",
        ),
    ],
)
def test_stalled_peer_times_out_and_the_next_exchange_succeeds(
    where: str, survivor_op: str, stalled_op: str
) -> None:
    r0, r1 = run_distributed(_stall_then_recover, 2, args=(where,), timeout_s=180)
    # The survivor gave up after its bounded wait and said who, what and when.
    assert r0["error"] is not None
    assert re.search(rf"rank 0: {survivor_op} for step 10 failed: timed out", r0["error"])
    # The stalled rank found the edge closed when it woke up.
    assert r1["error"] is not None
    assert re.search(rf"rank 1: {stalled_op} for step 10 failed: connection lost", r1["error"])
    # Exactly the edge that carried the stalled transfer was rebuilt, on both ends.
    edge = "0->1" if where == "alloc" else "1->0"
    assert r0["broken_after_failure"] == [edge] == r1["broken_after_failure"]
    assert r0["rebuilds"] == r1["rebuilds"] == 1
    assert r0["broken_now"] == r1["broken_now"] == []
    assert r0["next_equal"] and r1["next_equal"]


def _dead_peer_fails_fast_on_later_cycles(rank: int, world: int) -> list[str]:
    channel = ReplicationChannel(
        PairingPlan.build(2, 1), run_id=RUN, chunk_bytes=CHUNK, timeout_s=TIMEOUT_S
    )
    if rank == 1:
        kill_point("replication-before-exchange")
    errors = []
    for step in (10, 20):
        try:
            _exchange(channel, rank, step)
        except ReplicationError as exc:
            errors.append(str(exc))
    return errors


def test_a_dead_peer_fails_every_later_cycle_within_the_bound() -> None:
    survivor, dead = run_distributed(
        _dead_peer_fails_fast_on_later_cycles,
        2,
        kill={1: "replication-before-exchange"},
        timeout_s=120,
    )
    assert dead is None
    first, second = survivor
    assert "for step 10 failed" in first and "peer 1" in first
    # The broken edges are rebuilt before the next cycle; the dead peer never
    # arrives, so the rebuild itself fails within its bounded wait for the peer
    # (timeout_s) and says so.
    assert "connect replication edge" in second
    assert "with peer 1 for step 20 failed: timed out" in second
    assert f"the peer did not come within {TIMEOUT_S:g} s" in second


def _one_sided_failure(rank: int, world: int) -> dict[str, Any]:
    channel = ReplicationChannel(
        PairingPlan.build(2, 1), run_id=RUN, chunk_bytes=CHUNK, timeout_s=TIMEOUT_S * 10
    )
    _exchange(channel, rank, 10)
    if rank == 0:
        # What a failure seen only by rank 0 leaves behind (e.g. it timed out on the
        # last ack just as rank 1 finished): rank 0 dropped the edge, rank 1 does not
        # know yet.
        channel._out.mark_broken()
    dist.barrier()
    got = _exchange(channel, rank, 20)
    return {
        "equal": torch.equal(got.arena, _arena(1 - rank, 20)),
        "rebuilds": channel.rebuilds,
    }


def test_an_edge_dropped_by_one_side_is_rebuilt_within_the_next_cycle() -> None:
    # Rank 0 rebuilds first thing; rank 1 finds its end closed at the first message
    # and rebuilds at the same step's key, so the cycle still succeeds.
    out = run_distributed(_one_sided_failure, 2, timeout_s=120)
    assert out == [{"equal": True, "rebuilds": 1}, {"equal": True, "rebuilds": 1}]


def _progress_raises(rank: int, world: int) -> dict[str, Any]:
    def progress(direction: str, done: int, total: int) -> None:
        if rank == 1 and direction == "send" and 2 * done >= total:
            raise RuntimeError("progress hook failed")

    channel = ReplicationChannel(
        PairingPlan.build(2, 1),
        run_id=RUN,
        chunk_bytes=CHUNK,
        timeout_s=TIMEOUT_S * 10,
        progress=progress,
    )
    error = None
    try:
        _exchange(channel, rank, 10)
    except ReplicationError as exc:
        error = str(exc)
    broken = channel.broken_edges
    dist.barrier()
    channel._limits = type(channel._limits)(CHUNK, 4, 1 << 26)  # drop the failing hook
    got = _exchange(channel, rank, 20)
    return {
        "error": error,
        "broken": broken,
        "next_equal": torch.equal(got.arena, _arena(1 - rank, 20)),
    }


def test_an_exception_inside_a_transfer_drops_the_edge_and_the_peer_fails_fast() -> None:
    r0, r1 = run_distributed(_progress_raises, 2, timeout_s=120)
    assert r1["error"] == "replication exchange failed: progress hook failed"
    assert r1["broken"] == ["1->0"]
    # The peer does not wait out its timeout: the dropped edge closes at once.
    assert re.search(
        r"rank 0: receive chunk \d+/33 from peer 1 for step 10 failed: "
        r"connection lost",
        r0["error"],
    )
    assert r0["broken"] == ["1->0"]
    assert r0["next_equal"] and r1["next_equal"]

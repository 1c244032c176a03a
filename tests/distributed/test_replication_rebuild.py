"""The store agreement behind an edge rebuild, on two real ranks with real Gloo groups.

Issue 20, item 1: both endpoints agree on the attempt before connecting, a
failed connect is retried within the same rebuild, and a peer that comes after
the other gave the step up learns it at once instead of connecting to abandoned
keys. (The healing of replication as a whole is tested in
``test_gemini_replication.py``.)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.errors import ReplicationError
from lm_resiliency.replication._rebuild import JoinTimeout, PeerGaveUp, Rebuilds
from lm_resiliency.testing import run_distributed

TIMEOUT_S = 3.0


def _agreement(rank: int, name: str) -> Rebuilds:
    store = dist.distributed_c10d._get_default_store()
    return Rebuilds(store, f"test/{name}", me=rank, timeout_s=TIMEOUT_S)


def _sums_over(group: Any, rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    group.allreduce([t]).wait(timedelta(seconds=TIMEOUT_S))
    return float(t.item())


def _first_connect_fails_on_one_side(rank: int, world: int) -> dict[str, Any]:
    calls = []

    def connect(store: Any) -> Any:
        calls.append(len(calls))
        if rank == 1 and len(calls) == 1:  # this side's first connect fails
            raise ReplicationError("rank 1: connect failed (injected into our own callable)")
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))

    group = _agreement(rank, "retry").rebuild(20, connect, attempts=3)
    return {"connects": len(calls), "sum": _sums_over(group, rank)}


def test_a_failed_connect_is_retried_within_the_rebuild_on_both_sides() -> None:
    out = run_distributed(_first_connect_fails_on_one_side, 2, timeout_s=120)
    # Rank 0's first connect may succeed or time out alone; either way both endpoints
    # dropped that attempt together and met on the next one.
    assert out == [{"connects": 2, "sum": 3.0}, {"connects": 2, "sum": 3.0}]


def _late_peer(rank: int, world: int) -> str:
    agreement = _agreement(rank, "late")

    def connect(store: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))

    if rank == 0:
        with pytest.raises(JoinTimeout) as waited:
            agreement.rebuild(20, connect, attempts=3)
        dist.barrier()  # only now does rank 1 come to the rebuild
        return str(waited.value)
    dist.barrier()
    with pytest.raises(PeerGaveUp) as gave_up:
        agreement.rebuild(20, connect, attempts=3)
    return str(gave_up.value)


def test_a_peer_that_comes_after_the_other_gave_up_never_connects() -> None:
    waited, late = run_distributed(_late_peer, 2, timeout_s=120)
    assert waited == f"the peer did not come within {TIMEOUT_S:g} s"
    assert late == "the peer gave up this step's transfer (meeting)"


def _given_up_then_rebuilt(rank: int, world: int) -> dict[str, Any]:
    agreement = _agreement(rank, "again")

    def connect(store: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=TIMEOUT_S))

    if rank == 0:
        agreement.close(30)  # rank 0's transfer for step 30 failed earlier
    dist.barrier()
    first = None
    if rank == 1:  # rank 1 comes for step 30 and is told at once
        with pytest.raises(PeerGaveUp) as gave_up:
            agreement.rebuild(30, connect, attempts=3)
        first = str(gave_up.value)
    dist.barrier()
    # A later transfer for the same step (recovery sends that step's replica) meets.
    group = agreement.rebuild(30, connect, attempts=3)
    return {"first": first, "sum": _sums_over(group, rank)}


def test_a_step_given_up_can_still_be_rebuilt_by_a_later_transfer_of_that_step() -> None:
    out = run_distributed(_given_up_then_rebuilt, 2, timeout_s=120)
    assert out == [
        {"first": None, "sum": 3.0},
        {"first": "the peer gave up this step's transfer (meeting)", "sum": 3.0},
    ]

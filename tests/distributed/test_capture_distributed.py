"""Capture and local recovery on real Gloo ranks: the contract loop and the collective choice."""

from __future__ import annotations

import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig, RecoveryMode
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed


def _contract_loop(rank: int, world: int) -> dict:
    torch.manual_seed(rank)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshots = {}
    cfg = InMemoryCkptConfig(interval=3, replication_jump=1, disk_flush_interval=0)
    with InMemoryCheckpointManager(cfg) as manager:
        for step in range(1, 10):
            model(torch.randn(2, 4)).sum().backward()
            manager.maybe_wait()
            opt.step()
            opt.zero_grad()
            if step % manager.config.interval == 0:
                snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
                manager.save({"model": model.state_dict()}, step)
        latest = manager.find_latest()
        state = manager.load(latest)
        same = all(torch.equal(state["model"][k], snapshots[latest][k]) for k in snapshots[latest])
        return {"latest": latest, "same": same}


def test_contract_loop_on_two_ranks_recovers_the_newest_step_bit_exactly() -> None:
    out = run_distributed(_contract_loop, 2, timeout_s=120)
    assert out == [{"latest": 9, "same": True}] * 2


def _partial_newer_step(rank: int, world: int) -> tuple:
    # rank 2 never captures step 20, so replication of step 20 times out (quickly here)
    cfg = InMemoryCkptConfig(replication_jump=1, disk_flush_interval=0, replication_timeout_s=3)
    with InMemoryCheckpointManager(cfg) as manager:
        manager.save({"t": torch.full((3,), 10.0 + rank)}, 10)
        manager.maybe_wait()
        if rank != 2:  # step 20 exists on only part of the job
            manager.save({"t": torch.full((3,), 20.0 + rank)}, 20)
            manager.maybe_wait()
        latest = manager.find_latest()
        verified_before = manager.find_latest(RecoveryMode.RECOVERY_VERIFIED)
        manager.trust.mark_verified(10)
        verified = manager.find_latest(RecoveryMode.RECOVERY_VERIFIED)
        value = manager.load(latest)["t"][0].item()
        return latest, verified_before, verified, value


def test_a_step_present_on_only_part_of_the_job_is_never_chosen() -> None:
    out = run_distributed(_partial_newer_step, 3, timeout_s=120)
    assert [o[0] for o in out] == [10, 10, 10]
    assert [o[1] for o in out] == [None, None, None]
    assert [o[2] for o in out] == [10, 10, 10]
    assert [o[3] for o in out] == [10.0, 11.0, 12.0]

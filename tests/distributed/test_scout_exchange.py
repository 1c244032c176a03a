"""SCOUT's exchange at world 16: the group all-gather and the job's flags, O(1) in the world.

16 Gloo processes of a tiny MLP (replicas kept identical by an explicit gradient
all-reduce) compared in eight groups of two (``ComparisonGroups.hsdp(16,
shard_size=8)``). Each check moves the same bytes on every rank whatever the world
size: the 4 KiB spec broadcast, the group's reports (144 B x 2) and one all-reduce of
the flags (15 x 8 B). A fault on rank 13 makes its group [5, 13] inconclusive, and
every one of the 16 ranks refuses that capture (the job-wide flag).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scout_fixtures import Trainer, Verdicts

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.detection import ComparisonGroups, Scout, ScoutConfig, ScoutStatus
from lm_resiliency.detection.wire import FLAG_WORDS, REPORT_BYTES, SPEC_BYTES
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.testing import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WORLD, INTERVAL, FAULTY = 16, 2, 13


def _run(rank: int, world: int, tmp: str) -> dict:
    t = Trainer("mlp", rank=rank, world=world, ddp=False)
    cfg = InMemoryCkptConfig(interval=INTERVAL, disk_folder=tmp, run_id="x16", signal_flush=False)
    manager = InMemoryCheckpointManager(cfg)
    groups = ComparisonGroups.hsdp(world, shard_size=8)
    scout = Scout(ScoutConfig(), t.net, manager=manager.trust, groups=groups, interval=INTERVAL)
    faults = ComputeFaults([PersistentSDC(rank=FAULTY, module=t.model[2], from_step=3)], rank=rank)
    faults.arm()
    faults.install(t.opt)
    seen = Verdicts(scout)  # pipelined: step s's verdict is known at the next maybe_wait
    for step in range(1, 2 * INTERVAL + 1):  # the plain loop
        manager.maybe_wait()
        seen.collect()
        t.step()
        if step % INTERVAL == 0 and scout.before_capture(step):
            manager.save(t.state(step), step)
            seen.held.append(step)
            scout.after_capture(step)
    manager.maybe_wait()
    seen.collect()
    checks = [
        (r.step, r.status, r.capture_allowed, r.bytes_exchanged, r.reason)
        for _, r in sorted(seen.results.items())
    ]
    latest = manager.find_latest()
    scout.close()
    manager.close()
    return {"checks": checks, "held": seen.held, "latest": latest}


def test_world_16_exchange_is_group_local_and_agreement_is_one_small_all_reduce(
    tmp_path: Path,
) -> None:
    out = run_distributed(_run, WORLD, args=(str(tmp_path),), timeout_s=560)
    per_check = SPEC_BYTES + 2 * REPORT_BYTES + FLAG_WORDS * 8  # no factor of the world
    for rank, o in enumerate(out):
        (s2, st2, ok2, b2, _), (s4, st4, ok4, _b4, reason) = o["checks"]
        assert (s2, st2, ok2, b2) == (2, ScoutStatus.HEALTHY, True, per_check), (rank, o)
        # check 4 replays model[2], wrong on rank 13 only: group [5, 13] cannot tell which
        assert (s4, st4, ok4) == (4, ScoutStatus.INCONCLUSIVE, False), (rank, o)
        assert "[5, 13]" in reason, (rank, reason)
        # The capture at 4 was launched before its verdict and discarded when it resolved.
        assert (o["held"], o["latest"]) == ([2, 4], 2), (rank, o)

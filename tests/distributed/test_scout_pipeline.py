"""SCOUT's pipelined verdict (``ScoutConfig(pipeline=True)``), on real Gloo ranks.

A capture boundary replays and posts its group exchange; the verdict resolves at
the next ``maybe_wait`` (or the next SCOUT or capture call). Meanwhile the capture
is held uncommitted (``capture/gate.py``): never visible to recovery, discarded
when the verdict is an SDC. One test per call order that can follow a held
capture proves none of them waits forever on the gate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scout_fixtures import Trainer, digest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.detection import Scout, ScoutConfig, ScoutStatus
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.recovery.mode import RecoveryMode
from lm_resiliency.testing import run_distributed

INTERVAL = 5
ONSET = 12  # the fault starts after optimizer step 12; the next boundary is 15
pytestmark = pytest.mark.timeout(300)


def _manager(tmp: str, run_id: str) -> InMemoryCheckpointManager:
    cfg = InMemoryCkptConfig(
        interval=INTERVAL,
        disk_folder=tmp,
        disk_flush_interval=0,
        run_id=run_id,
        replication_chunk_size=1 << 16,
        signal_flush=False,
    )
    return InMemoryCheckpointManager(cfg)


def _late_sdc(rank: int, world: int, tmp: str) -> dict:
    t = Trainer("gpt", rank=rank, world=world, ddp=False)
    manager = _manager(tmp, "pipe-sdc")
    scout = Scout(
        ScoutConfig(interval=1, pipeline=True), t.net, manager=manager.trust, interval=INTERVAL
    )
    faults = ComputeFaults(
        [PersistentSDC(rank=1, module=t.model.blocks[0], from_step=ONSET)], rank=rank
    )
    faults.arm()
    faults.install(t.opt)
    captured: dict[int, str] = {}
    provisional: dict[int, bool] = {}
    resolved: dict[int, tuple] = {}
    held = None
    for step in range(1, 21):  # the plain loop
        manager.maybe_wait()  # resolves the previous boundary's verdict
        last = scout.last_result
        if (step - 1) % INTERVAL == 0 and step > 1 and last is not None:
            resolved[step - 1] = (last.step, last.status, last.faulty_ranks, last.capture_allowed)
        t.step()
        if step % INTERVAL == 0:
            provisional[step] = scout.before_capture(step)
            if provisional[step]:
                manager.save(t.state(step), step)
                captured[step] = digest(t.state(step))
                scout.after_capture(step)
            if step == 15:  # the verdict is pending: recovery must not see the capture
                # (find_latest waits for the capture in flight: it resolves the verdict)
                held = (scout.pending, manager.find_latest())
        else:
            scout.maybe_check(step)
    manager.maybe_wait()
    last = scout.last_result
    assert last is not None
    resolved[20] = (last.step, last.status, last.faulty_ranks, last.capture_allowed)
    verified = manager.find_latest(RecoveryMode.RECOVERY_VERIFIED)
    latest = manager.find_latest()
    loaded = manager.load(verified, mode=RecoveryMode.RECOVERY_VERIFIED)
    out = {
        "provisional": provisional,
        "resolved": resolved,
        "held": held,
        "verified": verified,
        "latest": latest,
        "discarded": manager.stats.discarded,
        "bit_identical": digest(loaded) == captured[verified],
        "verdict": manager.trust.recovery_verdict(),
    }
    scout.close()
    manager.close()
    return out


def test_an_sdc_found_one_step_late_still_skips_its_capture(tmp_path: Path) -> None:
    out = run_distributed(_late_sdc, 3, args=(str(tmp_path),), timeout_s=280)
    for rank, o in enumerate(out):
        # Step 15's capture was launched on a provisional yes, while its check was pending.
        assert o["provisional"] == {5: True, 10: True, 15: True, 20: False}, o
        assert o["held"] == (15, 10), f"rank {rank}: the held capture was visible: {o}"
        step, status, faulty, allowed = o["resolved"][15]
        assert (step, status, faulty, allowed) == (15, ScoutStatus.SDC, (1,), False), o
        assert o["discarded"] == 1, o  # dropped before its commit
        assert (o["verified"], o["latest"]) == (10, 10), o
        assert o["bit_identical"], f"rank {rank}: verified state differs from its capture"
        assert o["verdict"] is not None and o["verdict"].step == 15


ORDERS = [
    "maybe_wait",
    "maybe_wait_twice",
    "next_boundary_without_maybe_wait",
    "save_without_scout",
    "wait_persisted",
    "find_latest",
    "maybe_check",
    "no_save_then_maybe_wait",
    "scout_close_first",
    "manager_close_first",
]


def _order(rank: int, world: int, tmp: str, order: str) -> dict:
    t = Trainer("mlp", rank=rank, world=world, ddp=False)
    manager = _manager(tmp, f"pipe-{order.replace('_', '-')}")
    scout = Scout(ScoutConfig(pipeline=True), t.net, manager=manager.trust, interval=INTERVAL)
    for step in range(1, INTERVAL + 1):
        manager.maybe_wait()
        t.step()
    assert scout.before_capture(INTERVAL)
    if order != "no_save_then_maybe_wait":
        manager.save(t.state(INTERVAL), INTERVAL)
        scout.after_capture(INTERVAL)
    pending = scout.pending
    out: dict = {"pending": pending}
    if order == "maybe_wait":
        manager.maybe_wait()
    elif order == "maybe_wait_twice":
        manager.maybe_wait()
        manager.maybe_wait()
    elif order == "next_boundary_without_maybe_wait":
        assert scout.before_capture(2 * INTERVAL)  # a back-to-back boundary
        manager.save(t.state(2 * INTERVAL), 2 * INTERVAL)
        scout.after_capture(2 * INTERVAL)
        manager.maybe_wait()
    elif order == "save_without_scout":
        manager.save(t.state(INTERVAL + 1), INTERVAL + 1)
        manager.maybe_wait()
    elif order == "wait_persisted":
        assert manager.wait_persisted(60)
    elif order == "find_latest":
        out["latest_while_pending"] = manager.find_latest()
        manager.maybe_wait()
    elif order == "maybe_check":
        scout.check(INTERVAL + 1)
    elif order == "no_save_then_maybe_wait":
        manager.maybe_wait()
    if order == "scout_close_first":
        scout.close()
        out["latest"] = manager.find_latest()
        out["discarded"] = manager.stats.discarded
        manager.close()
        return out
    if order == "manager_close_first":
        stats = manager.stats
        manager.close()  # collective: waits for the capture in flight, so resolves its verdict
        out["resolved"] = scout.pending is None
        scout.close()
        out["discarded"] = stats.discarded
        return out
    out["resolved"] = scout.pending is None
    out["latest"] = manager.find_latest()
    out["discarded"] = manager.stats.discarded
    scout.close()
    manager.close()
    return out


_EXPECTED_LATEST = {
    "next_boundary_without_maybe_wait": 2 * INTERVAL,
    "save_without_scout": INTERVAL + 1,
    "no_save_then_maybe_wait": None,
}


@pytest.mark.parametrize("order", ORDERS)
def test_no_call_order_deadlocks_on_a_held_capture(tmp_path: Path, order: str) -> None:
    out = run_distributed(_order, 2, args=(str(tmp_path), order), timeout_s=200)
    for o in out:
        assert o["pending"] == INTERVAL, o  # the verdict was pending after the boundary
        if order != "manager_close_first":  # closed: nothing left to query
            assert o["latest"] == _EXPECTED_LATEST.get(order, INTERVAL), o
        assert o["discarded"] == 0, o  # clean: committed, whichever call resolved it
        if "resolved" in o:
            assert o["resolved"], o
        if order == "find_latest":  # it waits for the capture in flight: resolves the verdict
            assert o["latest_while_pending"] == INTERVAL, o

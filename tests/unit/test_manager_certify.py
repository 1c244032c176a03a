"""The manager's certification API for SCOUT: trust in memory at once, on disk in the background."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, RecoveryMode
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.persistence import RecoveryVerdict, TrustStatus
from lm_resiliency.persistence.scan import scan_checkpoints


def _cfg(tmp: Path) -> InMemoryCkptConfig:
    return InMemoryCkptConfig(
        disk_folder=tmp, disk_flush_interval=0, run_id="certify", signal_flush=False
    )


def _state(step: int) -> dict:
    return {"w": torch.full((4, 4), float(step)), "step": step}


def _trust_on_disk(tmp: Path) -> dict[int, str | None]:
    (run,) = scan_checkpoints(tmp)
    (topo,) = run.topologies
    return {g.step: g.shards[0].trust for g in topo.generations}


def test_certified_steps_are_persisted_with_their_trust_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    m = InMemoryCheckpointManager(_cfg(tmp_path))
    trust = {10: TrustStatus.RECOVERY_VERIFIED, 20: TrustStatus.CANDIDATE}
    for step in (10, 20, 30):
        m.save(_state(step), step)
        if step in trust:
            m.trust.certify(step, trust[step])  # the capture is still in flight
        m.maybe_wait()
    assert m.find_latest(RecoveryMode.RECOVERY_VERIFIED) == 10  # memory: at once
    m.trust.reject(20, reason="sdc on rank 1")
    m.trust.require_verified_recovery(40, reason="sdc on rank 1 at step 40")
    assert m.wait_persisted(timeout_s=30)
    # Step 30 was neither certified nor due for a periodic flush: never written.
    assert _trust_on_disk(tmp_path) == {10: "recovery_verified", 20: "candidate"}
    sidecar = json.loads((m.store().topology_path / "status-rank-0.json").read_text())
    assert sidecar["verified_history"] == [10] and sidecar["candidate_step"] is None
    assert sidecar["rejected"] == [{"step": 20, "reason": "sdc on rank 1"}]
    m.close(finished=False)  # the job stops after the SDC, unfinished

    # A new process: it re-attaches the memory slots (20 and 30) and reads the trust records.
    fresh = InMemoryCheckpointManager(_cfg(tmp_path))
    assert fresh.trust.recovery_verdict() == RecoveryVerdict(40, "sdc on rank 1 at step 40")
    assert fresh.find_latest(RecoveryMode.RECOVERY_VERIFIED) == 10
    assert fresh.find_latest() == 30  # the newest capture, never certified
    state = fresh.load(10, mode=RecoveryMode.RECOVERY_VERIFIED)
    assert torch.equal(state["w"], _state(10)["w"])
    fresh.trust.clear_recovery_verdict()
    assert fresh.trust.wait(timeout_s=30)
    fresh.close(finished=False)
    again = InMemoryCheckpointManager(_cfg(tmp_path))
    assert again.trust.recovery_verdict() is None
    again.close()


def test_promotion_needs_no_second_write_and_unverified_is_refused(tmp_path: Path) -> None:
    with InMemoryCheckpointManager(_cfg(tmp_path)) as m:
        m.save(_state(10), 10)
        m.trust.certify(10, TrustStatus.CANDIDATE)  # capture possibly still in flight
        m.maybe_wait()
        m.trust.certify(10, TrustStatus.RECOVERY_VERIFIED, persist=False)
        assert m.wait_persisted(timeout_s=30)
        # One write; its header has the trust known when it ran (candidate or already verified).
        assert m.flush_stats.written == 1
        assert _trust_on_disk(tmp_path)[10] in {"candidate", "recovery_verified"}
        assert m.store().sidecar.status().verified_history == (10,)
        assert m.find_latest(RecoveryMode.RECOVERY_VERIFIED) == 10
        with pytest.raises(ValueError, match="not UNVERIFIED"):
            m.trust.certify(10, TrustStatus.UNVERIFIED)


def test_trust_report_shows_each_generation_as_inspect_would(tmp_path: Path) -> None:
    from lm_resiliency.persistence.trust_view import trust_report

    cfg = InMemoryCkptConfig(
        disk_folder=tmp_path,
        disk_flush_interval=40,
        run_id="view",
        signal_flush=False,
        keep_generations=4,
    )
    with InMemoryCheckpointManager(cfg) as m:
        m.save(_state(0), 0)  # flushed by the periodic flush: never certified
        m.maybe_wait()
        for step, trust in ((10, TrustStatus.RECOVERY_VERIFIED), (20, TrustStatus.CANDIDATE)):
            m.save(_state(step), step)
            m.trust.certify(step, trust)
            m.maybe_wait()
        m.trust.certify(20, TrustStatus.RECOVERY_VERIFIED, persist=False)  # promoted
        m.save(_state(30), 30)
        m.trust.certify(30, TrustStatus.CANDIDATE)
        m.maybe_wait()
        m.trust.reject(30, reason="SCOUT at step 40: group [0, 1, 2] dense: SDC on ranks [1]")
        m.trust.require_verified_recovery(40, reason="SDC on ranks [1]")
        assert m.wait_persisted(timeout_s=30)
    (topo,) = trust_report(tmp_path)
    got = {g.step: (g.trust, g.why) for g in topo.generations}
    assert got == {
        0: ("unverified", "captured, not certified"),
        10: ("recovery_verified", "every rank recorded it as recovery-verified"),
        20: ("recovery_verified", "every rank recorded it as recovery-verified"),
        30: ("rejected", "rank 0: SCOUT at step 40: group [0, 1, 2] dense: SDC on ranks [1]"),
    }
    assert topo.verdicts == {0: RecoveryVerdict(40, "SDC on ranks [1]")}
    assert topo.unreadable == {}

"""Timelines: a generation of an abandoned history is never resumed and never crowds out the
new one; a finished run is not resumed by accident; a damaged sidecar costs no verified step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, RecoveryMode
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.persistence.lineage import Lineage, Timeline, merge

torch.set_num_threads(1)


def _state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def _cfg(disk: Path, **kw) -> InMemoryCkptConfig:
    base = {
        "run_id": "timeline-test",
        "disk_folder": str(disk),
        "interval": 10,
        "disk_flush_interval": 10,
        "keep_generations": 1,
        "memory_folder": None,  # disk only: every step here comes from files
        "signal_flush": False,
    }
    return InMemoryCkptConfig(**{**base, **kw})


def _train(m: InMemoryCheckpointManager, steps: range) -> None:
    for s in steps:
        if s % 10 == 0:
            m.save(_state(s), s)
            m.maybe_wait()
    m.wait_persisted()


def _on_disk(disk: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in disk.glob("run-*/topo-*/step-*"))


def test_a_restart_from_a_durable_checkpoint_supersedes_the_abandoned_history(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    first = InMemoryCheckpointManager(_cfg(disk))
    _train(first, range(1, 101))  # the old timeline reached step 100
    first.close(finished=False)
    assert _on_disk(disk) == [100]

    # The job fell back to a durable checkpoint at step 40 and trains on, same run id.
    second = InMemoryCheckpointManager(_cfg(disk))
    _train(second, range(41, 61))
    assert _on_disk(disk) == [60]  # step 100 of the abandoned timeline is gone, 60 kept
    second.close(finished=False)

    third = InMemoryCheckpointManager(_cfg(disk))
    assert third.find_latest() == 60  # never the abandoned step 100
    assert torch.equal(third.load(60)["w"], _state(60)["w"])
    third.close(finished=False)


def test_a_resumed_timeline_keeps_its_ancestors_generations_up_to_the_fork(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = InMemoryCheckpointManager(_cfg(disk, keep_generations=3))
    _train(first, range(1, 31))
    first.close(finished=False)
    second = InMemoryCheckpointManager(_cfg(disk, keep_generations=3))
    assert second.find_latest() == 30
    second.load(20)  # resumed at 20: the old timeline's 30 is not on this history
    _train(second, range(21, 41))
    second.close(finished=False)
    third = InMemoryCheckpointManager(_cfg(disk, keep_generations=3))
    assert third.find_latest() == 40
    assert torch.equal(third.load(30)["w"], _state(30)["w"])  # 30 of the *new* timeline
    third.close(finished=False)
    assert _on_disk(disk) == [20, 30, 40]


def test_a_finished_run_is_not_resumed_and_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    done = InMemoryCheckpointManager(_cfg(disk))
    _train(done, range(1, 36))
    done.close()  # after the last step: finished
    with caplog.at_level(logging.WARNING):
        relaunch = InMemoryCheckpointManager(_cfg(disk))
        assert relaunch.find_latest() is None
    lines = [r.getMessage() for r in caplog.records if "finished at step" in r.getMessage()]
    assert len(lines) == 1 and "resume='finished'" in lines[0]
    _train(relaunch, range(1, 11))  # a new training from scratch under the same id
    relaunch.close(finished=False)
    assert _on_disk(disk) == [10]


def test_a_damaged_sidecar_never_costs_the_verified_generation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    m = InMemoryCheckpointManager(_cfg(disk))
    _train(m, range(1, 11))
    m.trust.mark_verified(10)
    (sidecar,) = disk.glob("run-*/topo-*/status-rank-0.json")
    sidecar.write_text('{"kind": "lm_resiliency.status", "garbage": ')
    m.close(finished=False)
    with caplog.at_level(logging.WARNING):
        again = InMemoryCheckpointManager(_cfg(disk))
        assert again.find_latest() == 10
        again.load(10)  # resumed: step 10 is on this job's history
        _train(again, range(11, 41))  # keep_generations=1 retires 20 and 30, never 10
    assert "rebuilt it from the shards' own metadata (verified steps [10])" in caplog.text
    assert _on_disk(disk) == [10, 40]
    verdict = again.trust.recovery_verdict()  # what SCOUT kept there is unknown: stay conservative
    assert verdict is not None and "damaged and rebuilt" in verdict.reason
    assert again.find_latest(RecoveryMode.RECOVERY_VERIFIED) == 10
    again.close(finished=False)


def test_lineage_eligibility_follows_the_ancestry_up_to_each_fork() -> None:
    lin = Lineage((Timeline("a"), Timeline("b", "a", 20), Timeline("c", "b", 35)))
    assert lin.eligible(50, "c") and lin.eligible(35, "b") and lin.eligible(20, "a")
    assert not lin.eligible(40, "b") and not lin.eligible(30, "a")
    assert not lin.eligible(10, "unknown") and not lin.superseded(10, "unknown")
    assert lin.superseded(30, "a")
    assert Lineage().eligible(7, None)  # no history recorded: everything is eligible
    longest, consistent = merge([Lineage(lin.timelines[:2]), lin])
    assert longest == lin and consistent
    _, consistent = merge([lin, Lineage((Timeline("x"),))])
    assert not consistent


def test_a_rejected_step_loses_its_trust_marker(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    m = InMemoryCheckpointManager(_cfg(disk, keep_generations=3))
    _train(m, range(1, 21))
    m.trust.mark_verified(20)
    assert list(disk.glob("run-*/topo-*/step-20/trust-rank-0.json"))
    m.trust.reject(20, reason="SCOUT: inconclusive")
    m.wait_persisted()
    assert not list(disk.glob("run-*/topo-*/step-20/trust-rank-*.json"))
    m.close(finished=False)

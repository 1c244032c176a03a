"""Sidecar version 2: rejected generations and SCOUT's recovery verdict; version 1 still reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_resiliency.errors import SidecarUnavailable
from lm_resiliency.persistence import RecoveryVerdict, ShardStore


def _store(tmp_path: Path, rank: int = 0) -> ShardStore:
    return ShardStore(
        tmp_path, run_id="r", topology="t", rank=rank, verify_integrity=False, sidecar_retry_s=0.0
    )


def _doc(store: ShardStore) -> dict:
    return json.loads((store.topology_path / f"status-rank-{store.rank}.json").read_text())


def test_a_record_without_the_new_fields_is_still_written_as_version_1(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_verified(10)
    store.sidecar.mark_candidate(20)
    doc = _doc(store)
    assert doc["version"] == 1 and "rejected" not in doc and "verdict" not in doc


def test_version_1_file_of_today_reads_with_no_rejections_and_no_verdict(tmp_path: Path) -> None:
    path = _store(tmp_path).topology_path / "status-rank-0.json"
    v1 = {
        "kind": "lm_resiliency.status",
        "version": 1,
        "run_id": "r",
        "topology": "t",
        "rank": 0,
        "candidate_step": 30,
        "verified_step": 20,
        "verified_history": [10, 20],
        "persisted": {"0": 30},
    }
    path.write_text(json.dumps(v1))
    status = _store(tmp_path, rank=1).sidecar.read_status(0)
    assert status is not None
    assert (status.candidate_step, status.verified_history, status.persisted) == (
        30,
        (10, 20),
        {0: 30},
    )
    assert status.rejected == () and status.verdict is None


def test_rejection_and_verdict_round_trip_as_version_2(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_verified(10)
    store.sidecar.mark_candidate(20)
    store.sidecar.mark_rejected(20, "sdc on rank 1 at step 30")
    store.sidecar.set_verdict(RecoveryVerdict(step=30, reason="sdc on rank 1"))
    doc = _doc(store)
    assert doc["version"] == 2
    assert doc["rejected"] == [{"step": 20, "reason": "sdc on rank 1 at step 30"}]
    assert doc["verdict"] == {"mode": "recovery_verified", "step": 30, "reason": "sdc on rank 1"}
    back = _store(tmp_path, rank=1).sidecar.read_status(0)
    assert back is not None
    assert back.candidate_step is None and back.verified_history == (10,)
    assert back.rejected == ((20, "sdc on rank 1 at step 30"),)
    assert back.verdict == RecoveryVerdict(step=30, reason="sdc on rank 1")
    # A fresh store of the same rank inherits the verdict (a restarted job sees it).
    assert _store(tmp_path).sidecar.status().verdict == back.verdict


def test_rejecting_a_verified_step_removes_it_and_a_new_capture_clears_the_rejection(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_verified(10)
    store.sidecar.mark_verified(20)
    status = store.sidecar.mark_rejected(20, "why")
    assert status.verified_history == (10,) and status.verified_step == 10
    status = store.sidecar.mark_candidate(20)  # the same step number captured again after a rewind
    assert status.rejected == () and status.candidate_step == 20
    store.sidecar.set_verdict(RecoveryVerdict(step=5, reason="x"))
    assert store.sidecar.set_verdict(None).verdict is None
    assert _doc(store)["version"] == 1


@pytest.mark.parametrize(
    "changes",
    [
        {"rejected": [{"step": 5}]},
        {"rejected": [{"step": 5, "reason": 3}]},
        {"rejected": "x"},
        {"verdict": {"mode": "latest", "step": 1, "reason": "x"}},
        {"verdict": {"step": 1, "reason": "x"}},
        {"verdict": {"mode": "recovery_verified", "step": -1, "reason": "x"}},
        {"version": 1},  # version-2 keys under version 1
    ],
)
def test_malformed_version_2_fields_fail_closed(tmp_path: Path, changes: dict) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_rejected(4, "why")
    path = store.topology_path / "status-rank-0.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))
    with pytest.raises(SidecarUnavailable) as info:
        store.sidecar.read_status(0)
    assert info.value.reason == "schema"


def test_unordered_rejections_fail_closed_as_a_trust_mismatch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_rejected(4, "a")
    store.sidecar.mark_rejected(8, "b")
    path = store.topology_path / "status-rank-0.json"
    doc = json.loads(path.read_text())
    doc["rejected"].reverse()
    path.write_text(json.dumps(doc))
    with pytest.raises(SidecarUnavailable) as info:
        store.sidecar.read_status(0)
    assert info.value.reason == "trust"

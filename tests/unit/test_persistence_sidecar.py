"""Status sidecar: atomic replacement under a concurrent reader, bounded retries, fail closed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lm_resiliency.errors import SidecarUnavailable
from lm_resiliency.persistence import ShardStore

WRITES = 400

_WRITER = textwrap.dedent(
    """
    import sys
    from lm_resiliency.persistence import ShardStore
    store = ShardStore(sys.argv[1], run_id="r", topology="t", rank=0, verify_integrity=True)
    print("ready", flush=True)
    for step in range(1, int(sys.argv[2]) + 1):
        store.sidecar.mark_candidate(step)
        if step % 50 == 0:
            store.sidecar.mark_verified(step - 25)  # an older step: the candidate stays
    """
)


def _store(tmp_path: Path, rank: int = 0, retry_s: float = 2.0) -> ShardStore:
    return ShardStore(
        tmp_path,
        run_id="r",
        topology="t",
        rank=rank,
        verify_integrity=True,
        sidecar_retry_s=retry_s,
    )


def test_reader_never_sees_a_partial_sidecar_while_another_process_replaces_it(
    tmp_path: Path,
) -> None:
    reader = _store(tmp_path, rank=1, retry_s=0.0)  # no retry: a torn read would raise
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(WRITES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
    seen: list[int] = []
    while writer.poll() is None:
        status = reader.sidecar.read_status(0)
        if status is not None:
            assert (status.run_id, status.topology, status.rank) == ("r", "t", 0)
            assert status.candidate_step is not None
            seen.append(status.candidate_step)
            if status.verified_step is not None:
                assert status.verified_step % 50 == 25
                assert status.verified_history[-1] == status.verified_step
    assert writer.wait(timeout=120) == 0
    final = reader.sidecar.read_status(0)
    assert final is not None and final.candidate_step == WRITES
    assert final.verified_history == tuple(range(25, WRITES, 50))[-16:]
    assert seen == sorted(seen)  # replacements are observed in order, never torn
    assert len(seen) > 0


def test_reader_retries_an_undecodable_sidecar_until_it_becomes_valid(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_candidate(5)
    path = store.topology_path / "status-rank-0.json"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # what a remote client may briefly observe

    def heal() -> None:
        time.sleep(0.3)
        path.write_bytes(good)

    healer = threading.Thread(target=heal)
    healer.start()
    reader = _store(tmp_path, rank=1, retry_s=60.0)
    status = reader.sidecar.read_status(0)
    healer.join()
    assert status is not None and status.candidate_step == 5


def test_persistently_malformed_sidecar_fails_closed(tmp_path: Path) -> None:
    store = _store(tmp_path, retry_s=0.2)
    store.sidecar.mark_candidate(5)
    path = store.topology_path / "status-rank-0.json"
    path.write_bytes(b'{"kind": "lm_resiliency.st\xff')
    with pytest.raises(SidecarUnavailable) as info:
        store.sidecar.read_status(0)
    assert info.value.reason == "malformed" and "stayed undecodable" in str(info.value)


def _rewrite(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"run_id": "other"}, "identity"),
        ({"rank": 3}, "identity"),
        ({"version": 9}, "schema"),
        ({"extra": 1}, "schema"),
        ({"verified_history": [30, 20], "verified_step": 20}, "trust"),
        ({"verified_history": [10, 20], "verified_step": 10}, "trust"),
        ({"candidate_step": -1}, "schema"),
    ],
)
def test_decoded_mismatch_fails_closed_without_retrying(
    tmp_path: Path, changes: dict, reason: str
) -> None:
    store = _store(tmp_path, retry_s=3600.0)  # a retry would hit the test timeout
    store.sidecar.mark_verified(10)
    _rewrite(store.topology_path / "status-rank-0.json", **changes)
    with pytest.raises(SidecarUnavailable) as info:
        store.sidecar.read_status(0)
    assert info.value.reason == reason
    assert "treated as unknown" in str(info.value)


def test_damaged_own_sidecar_is_not_trusted_at_construction(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.sidecar.mark_verified(10)
    _rewrite(store.topology_path / "status-rank-0.json", run_id="other")
    fresh = _store(tmp_path, retry_s=0.0)
    assert fresh.sidecar.status().verified_history == ()  # unknown, never inherited
    fresh.sidecar.mark_verified(20)
    on_disk = fresh.sidecar.read_status(0)
    assert on_disk is not None and on_disk.verified_history == (20,)


def test_missing_sidecar_reads_as_none(tmp_path: Path) -> None:
    assert _store(tmp_path).sidecar.read_status(7) is None

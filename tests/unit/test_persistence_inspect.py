"""``lm-resiliency inspect``: listing, --verify catching a corrupted shard, --json."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from lm_resiliency.capture import Layout
from lm_resiliency.cli.main import main
from lm_resiliency.persistence import ShardStore, TrustStatus
from lm_resiliency.state import encode_state

torch.set_num_threads(1)


def _populate(root: Path) -> ShardStore:
    layout = Layout.from_tensors([torch.empty(1024, dtype=torch.float32)], ["w"])
    arena = torch.ones(layout.total_bytes, dtype=torch.uint8)
    store = ShardStore(root, run_id="demo-run", topology="c" * 64, rank=0, verify_integrity=True)
    for step, trust in ((10, TrustStatus.RECOVERY_VERIFIED), (20, TrustStatus.CANDIDATE)):
        for owner in (0, 2):
            store.write(
                owner_rank=owner,
                step=step,
                layout=layout,
                arena=arena,
                state_document=encode_state({"w": torch.empty(1024)}).document,
                trust=trust,
            )
    store.sidecar.mark_verified(10)
    store.sidecar.mark_candidate(20)
    store.close()
    return store


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8 + struct.unpack("<Q", raw[:8])[0] + 100] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_lists_runs_topologies_generations_ranks_sizes_and_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _populate(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run_id='demo-run'" in out and store.topology_path.name in out
    assert "fingerprint=" + "c" * 16 in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("10", "20")]
    assert [(r[0], r[1], r[4]) for r in rows] == [
        ("10", "0", "recovery_verified"),
        ("10", "2", "recovery_verified"),
        ("20", "0", "candidate"),
        ("20", "2", "candidate"),
    ]
    size = store.path_for(0, 10).stat().st_size
    assert f"{size / 1024:.1f} KiB" in out
    assert '"verified_step": 10' in out and '"candidate_step": 20' in out


def test_verify_reports_a_corrupted_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _populate(tmp_path)
    _corrupt(store.path_for(2, 20))
    assert main(["inspect", str(tmp_path)]) == 0  # headers alone are intact
    capsys.readouterr()
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("ok, CRC verified") == 3
    assert "UNAVAILABLE (checksum_mismatch)" in out
    assert f"problem: shard {store.path_for(2, 20)} is unavailable (checksum_mismatch)" in out


def test_json_output_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = _populate(tmp_path)
    _corrupt(store.path_for(0, 10))
    assert main(["inspect", "--verify", "--json", str(tmp_path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    (run,) = doc["runs"]
    assert run["run_id"] == "demo-run"
    (topo,) = run["topologies"]
    assert topo["topology"] == "c" * 64
    assert [g["step"] for g in topo["generations"]] == [10, 20]
    shards = {(g["step"], s["owner_rank"]): s for g in topo["generations"] for s in g["shards"]}
    assert shards[(10, 0)]["problem"] == "checksum_mismatch"
    assert shards[(10, 2)]["problem"] is None and shards[(10, 2)]["verified_crc"] is True
    assert shards[(20, 2)]["trust"] == "candidate"
    assert shards[(20, 2)]["size_bytes"] == store.path_for(2, 20).stat().st_size
    assert topo["sidecars"]["0"]["verified_history"] == [10]


def test_symlinked_shard_and_foreign_temp_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _populate(tmp_path / "ckpt")
    victim = store.path_for(0, 20)
    victim.unlink()
    victim.symlink_to(store.path_for(0, 10))
    temp = store.topology_path / f".rank-0.safetensors.lmr-{'0' * 32}-1-5-0.tmp"
    temp.write_bytes(b"x")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "UNAVAILABLE (symlink)" in out
    assert "another boot or PID namespace: never reaped" in out


def test_empty_and_missing_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 0
    assert "no lm-resiliency runs" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    assert "cannot read" in capsys.readouterr().err

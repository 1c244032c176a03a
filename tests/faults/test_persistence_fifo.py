"""A FIFO in place of a sidecar, manifest or shard is refused at once, never waited on (#12, 5).

Opening a FIFO for reading blocks until a writer appears; before the fix
``find_latest()`` and ``lm-resiliency inspect`` hung forever. Each test is
bounded by pytest-timeout: a hang fails it instead of blocking the suite.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture import Layout
from lm_resiliency.cli.main import main
from lm_resiliency.errors import ShardUnavailable, SidecarUnavailable, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence.identity import agree_job_fingerprint, topology_fingerprint

torch.set_num_threads(1)
TOPO = "f" * 64

pytestmark = pytest.mark.timeout(20)


def _store(root: Path, topology: str = TOPO) -> ShardStore:
    return ShardStore(root, run_id="fifo-run", topology=topology, rank=0, verify_integrity=False)


def _write(store: ShardStore, step: int) -> Path:
    tensor = torch.arange(16, dtype=torch.float32)
    layout = Layout.from_tensors([tensor], ["w"])
    arena = tensor.view(torch.uint8).clone()
    return store.write(owner_rank=0, step=step, layout=layout, arena=arena, state_document={})


def _fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def test_fifo_status_sidecars_are_refused_not_waited_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    _write(store, 2)
    store.sidecar.mark_verified(2)
    store.close()
    own = store.topology_path / "status-rank-0.json"
    peer = store.topology_path / "status-rank-1.json"  # another rank's, on the same node
    _fifo_in_place_of(own)
    os.mkfifo(peer, 0o600)
    with caplog.at_level(logging.WARNING, logger="lm_resiliency"):
        reopened = _store(tmp_path)  # reads its own sidecar: unknown, logged, not fatal
    assert f"status sidecar {own} is unusable (not_a_file)" in caplog.text
    assert "is a FIFO" in caplog.text
    assert reopened.steps(0) == [2]
    with pytest.raises(SidecarUnavailable) as info:
        reopened.sidecar.read_status(1)
    assert info.value.reason == "not_a_file" and info.value.path == str(peer)
    assert main(["inspect", str(tmp_path)]) == 1
    assert f"problem: status sidecar {peer} is unusable (not_a_file)" in capsys.readouterr().out
    reopened.sidecar.mark_candidate(2)  # its own sidecar is a real file again after an update
    assert own.is_file()
    reopened.close()


@pytest.mark.parametrize("manifest", ["run.json", "topology.json"])
def test_fifo_manifest_makes_recovery_refuse_the_folder(tmp_path: Path, manifest: str) -> None:
    topology = agree_job_fingerprint(topology_fingerprint([0], []))  # a 1-rank job's
    store = _store(tmp_path, topology=topology)
    _write(store, 2)
    store.close()
    path = store.topology_path / manifest
    if manifest == "run.json":
        path = store.topology_path.parent / manifest
    _fifo_in_place_of(path)
    cfg = InMemoryCkptConfig(disk_folder=tmp_path, run_id="fifo-run", signal_flush=False)
    with pytest.raises(UnsafePathError) as info:  # at construction or at find_latest()
        manager = InMemoryCheckpointManager(cfg)
        try:
            manager.find_latest()
        finally:
            manager.close()
    assert info.value.reason == "not_a_file" and info.value.path == str(path)
    assert f"{path} is a FIFO" in str(info.value)


def test_fifo_shard_is_unavailable_and_inspect_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    _write(store, 2)
    shard = _write(store, 4)
    _fifo_in_place_of(shard)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=4)
    assert info.value.reason == "not_a_file" and "is a FIFO" in str(info.value)
    assert store.steps(0) == [2]  # never offered to recovery
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "UNAVAILABLE (not_a_file)" in out
    assert f"problem: shard {shard} is unavailable (not_a_file)" in out
    store.close()

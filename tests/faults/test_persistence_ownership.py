"""Folders and files another local user owns or can write are refused, never used (#12, 2).

These tests run as root so they can hand entries to a second user (``nobody``)
with ``chown``, exactly what another account on the node would own had it
created them. Outside root they are skipped.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture import Layout
from lm_resiliency.cli.main import main
from lm_resiliency.errors import ShardUnavailable, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence.identity import agree_job_fingerprint, topology_fingerprint

torch.set_num_threads(1)
TOPO = "d" * 64

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown entries to another user"),
    pytest.mark.timeout(60),
]


def _other() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for sub in path.rglob("*"):
        os.chown(sub, uid, uid, follow_symlinks=False)


def _store(root: Path, *, run_id: str = "run-1", topology: str = TOPO) -> ShardStore:
    return ShardStore(root, run_id=run_id, topology=topology, rank=0, verify_integrity=True)


def _write(store: ShardStore, step: int, value: float) -> Path:
    tensor = torch.full((32,), value)
    layout = Layout.from_tensors([tensor], ["w"])
    arena = tensor.view(torch.uint8).clone()
    return store.write(owner_rank=0, step=step, layout=layout, arena=arena, state_document={})


def _shared_tmp(tmp_path: Path) -> Path:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)  # like /tmp: everybody may create entries, only owners remove them
    return folder


def test_a_run_folder_another_user_created_is_refused_with_owner_mode_and_fix(
    tmp_path: Path,
) -> None:
    disk = _shared_tmp(tmp_path)
    probe = _store(tmp_path / "probe")
    planted = disk / probe.topology_path.parent.name  # the run folder the victim will use
    planted.mkdir()
    planted.chmod(0o777)
    os.chown(planted, _other().pw_uid, _other().pw_gid)
    with pytest.raises(UnsafePathError) as info:
        _store(disk)
    msg = str(info.value)
    assert info.value.reason == "foreign_owner" and info.value.path == str(planted)
    assert f"{planted} is owned by nobody (uid {_other().pw_uid}) (mode 0777)" in msg
    assert "owned by the user running the job (root (uid 0))" in msg
    assert "mkdir -m 700" in msg
    assert list(planted.iterdir()) == []  # nothing was written into it


def test_a_swapped_in_topology_folder_is_refused_by_recovery_and_inspect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = _shared_tmp(tmp_path)
    topology = agree_job_fingerprint(topology_fingerprint([0], []))  # a 1-rank job's
    victim = ShardStore(disk, run_id="job-7", topology=topology, rank=0, verify_integrity=False)
    _write(victim, 4, 1.0)
    victim.close()
    # Another user ran a genuine job with the same run id elsewhere and swaps its
    # topology folder in place of the victim's (the run folder is the victim's).
    other = ShardStore(tmp_path / "other", run_id="job-7", topology=topology, rank=0,
                       verify_integrity=False)  # fmt: skip
    _write(other, 9, 666.0)
    other.close()
    shutil.rmtree(victim.topology_path)
    shutil.copytree(other.topology_path, victim.topology_path)
    _chown_tree(victim.topology_path, _other().pw_uid)
    # The restarted victim: refused at construction, at find_latest(), or the folder
    # yields nothing and a warning names it - never the other user's step 9.
    cfg = InMemoryCkptConfig(disk_folder=disk, run_id="job-7", signal_flush=False)
    refusal: UnsafePathError | None = None
    with caplog.at_level(logging.WARNING, logger="lm_resiliency"):
        try:
            manager = InMemoryCheckpointManager(cfg)
        except UnsafePathError as exc:
            refusal = exc
        else:
            try:
                assert manager.topology == topology
                assert manager.find_latest() is None
            except UnsafePathError as exc:
                refusal = exc
            finally:
                manager.close()
    if refusal is not None:
        assert refusal.reason == "foreign_owner" and refusal.path == str(victim.topology_path)
    else:
        assert f"{victim.topology_path} is owned by nobody (uid" in caplog.text
    assert main(["inspect", "--verify", str(disk)]) == 1
    out = capsys.readouterr().out
    assert f"problem: {victim.topology_path} is owned by nobody" in out


def test_group_writable_run_folder_and_unsticky_open_root_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    _write(store, 1, 1.0)
    store.close()
    run_dir = store.topology_path.parent
    run_dir.chmod(0o770)
    with pytest.raises(UnsafePathError, match=f"chmod go-w {run_dir}") as info:
        _store(tmp_path / "ckpt")
    assert info.value.reason == "writable_by_others" and "mode 0770" in str(info.value)
    run_dir.chmod(0o700)
    (tmp_path / "ckpt").chmod(0o777)  # anybody may rename our run folder away: refused
    with pytest.raises(UnsafePathError, match="without the sticky bit") as info:
        _store(tmp_path / "ckpt")
    assert info.value.reason == "writable_by_others"
    (tmp_path / "ckpt").chmod(0o1777)  # a shared sticky root like /tmp is fine
    assert _store(tmp_path / "ckpt").steps(0) == [1]


def test_created_modes_and_foreign_or_writable_shards_are_not_used(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    path = _write(store, 1, 1.0)
    _write(store, 2, 2.0)
    for p in (store.topology_path.parent, store.topology_path, path.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    for p in (path, store.topology_path / "topology.json", store.topology_path.parent / "run.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    os.chown(path, _other().pw_uid, _other().pw_gid)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=1)
    assert info.value.reason == "foreign_owner" and "nobody" in str(info.value)
    second = store.path_for(0, 2)
    second.chmod(0o622)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=2)
    assert info.value.reason == "writable_by_others" and f"chmod 600 {second}" in str(info.value)
    assert store.steps(0) == []  # neither is offered to recovery
    store.close()

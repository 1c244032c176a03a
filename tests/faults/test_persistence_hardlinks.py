"""Recycling never writes through a hard link or into a file that is not ours (#12, finding 1).

Retention parks a retired shard and the next write overwrites it in place.
Before the fix a file outside the folder, hard-linked in place of an old shard,
received checkpoint bytes, and a ``cp -al`` backup of the folder was silently
destroyed. Each test writes real generations and compares the other file(s)
byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lm_resiliency.capture import Layout
from lm_resiliency.persistence import ShardStore

torch.set_num_threads(1)
TOPO = "e" * 64


def _store(root: Path, *, keep: int) -> ShardStore:
    return ShardStore(root, run_id="links", topology=TOPO, rank=0, verify_integrity=True,
                      keep_generations=keep)  # fmt: skip


def _write(store: ShardStore, step: int) -> None:
    tensor = torch.full((4096,), float(step))
    layout = Layout.from_tensors([tensor], ["w"])
    arena = tensor.view(torch.uint8).clone()
    store.write(owner_rank=0, step=step, layout=layout, arena=arena, state_document={"s": step})


def _assert_holds(store: ShardStore, step: int) -> None:
    shard = store.read(owner_rank=0, step=step)
    (w,) = shard.layout.views(shard.arena)
    assert torch.equal(w, torch.full((4096,), float(step))) and shard.state_document == {"s": step}


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_file_outside_hard_linked_in_place_of_an_old_shard_survives(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt", keep=1)
    _write(store, 1)
    outside = tmp_path / "precious.bin"
    outside.write_bytes(os.urandom(20_000))
    before = outside.read_bytes()
    old = store.path_for(0, 1)
    old.unlink()
    os.link(outside, old)  # the old shard is now a second name of the outside file
    for step in (2, 3, 4):  # 2 retires step 1; 3 and 4 would reuse a parked spare
        _write(store, step)
    assert outside.read_bytes() == before
    assert os.stat(outside).st_nlink == 1  # only our link to it was removed
    assert store.steps(0) == [4]
    _assert_holds(store, 4)
    store.close()


def test_a_cp_al_backup_of_the_folder_survives_more_generations(tmp_path: Path) -> None:
    disk, backup = tmp_path / "ckpt", tmp_path / "backup"
    store = _store(disk, keep=2)
    for step in (1, 2, 3):  # step 1 retired: a spare is parked and enters the backup too
        _write(store, step)
    subprocess.run(["cp", "-al", str(disk), str(backup)], check=True)
    saved = _digests(backup)
    assert any(name.endswith(".tmp") for name in saved)  # the parked spare is linked too
    assert len(saved) >= 6  # manifests, sidecar, 2 shards, the spare
    for step in range(4, 9):  # every old shard and the spare get retired and recycled
        _write(store, step)
    assert _digests(backup) == saved
    assert store.steps(0) == [7, 8]
    _assert_holds(store, 7)
    _assert_holds(store, 8)
    store.close()


def test_plain_spares_are_still_recycled_in_place(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt", keep=1)
    _write(store, 1)
    inode = store.path_for(0, 1).stat().st_ino
    _write(store, 2)  # parks step 1's file
    _write(store, 3)  # overwrites it in place
    assert store.path_for(0, 3).stat().st_ino == inode
    _assert_holds(store, 3)
    store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a spare to another user")
def test_a_spare_handed_to_another_user_is_not_overwritten(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt", keep=1)
    _write(store, 1)
    _write(store, 2)  # step 1's file is now a parked spare
    (spare,) = [p for p in store.topology_path.iterdir() if p.name.endswith(".tmp")]
    os.chown(spare, 65534, 65534)  # a single link, but no longer ours
    # An open descriptor (not a link) lets us read the file after the store let go of it.
    fd = os.open(spare, os.O_RDONLY)
    try:
        before = os.pread(fd, 1 << 20, 0)
        inode = os.fstat(fd).st_ino
        _write(store, 3)
        assert os.pread(fd, 1 << 20, 0) == before
        assert store.path_for(0, 3).stat().st_ino != inode
    finally:
        os.close(fd)
    _assert_holds(store, 3)
    store.close()

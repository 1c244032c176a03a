"""The memory tier fails closed: no room of any kind falls back (or raises when required),
damaged slot bytes are never loaded, and a folder or lock that is not ours is refused."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.errors import ResiliencyError, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory import MemoryFolderFull
from lm_resiliency.memory.slotfile import PAGE

torch.set_num_threads(1)
ROOT = os.geteuid() == 0


def _state(step: int, n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g)}, "step": step}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _cfg(**kw) -> InMemoryCkptConfig:
    base = {"run_id": "fail-closed", "disk_flush_interval": 0, "signal_flush": False}
    return InMemoryCkptConfig(**{**base, **kw})


def _crash_after(steps: tuple[int, ...], **kw) -> None:
    m = InMemoryCheckpointManager(_cfg(**kw))
    for s in steps:
        m.save(_state(s), s)
        m.maybe_wait()
    m.close(finished=False)


def _slot_with(folder: Path, step: int) -> Path:
    for p in folder.glob("run-*/topo-*/rank-0/*.slot"):
        if struct.unpack("<q", p.read_bytes()[24:32])[0] == step:
            return p
    raise AssertionError(f"no slot file of step {step}")


# -- item 7: out of inodes is out of room -------------------------------------------------


@pytest.fixture
def inode_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs with plenty of bytes but only 8 inodes (unmounted afterwards)."""
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "few-inodes"
    mount.mkdir()
    opts = "size=64m,nr_inodes=8"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted on this machine")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _use_up_inodes(mount: Path) -> None:
    for i in range(64):
        try:
            (mount / f"filler-{i}").touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            return
    raise AssertionError("the tmpfs never ran out of inodes")


def test_no_inode_for_a_slot_falls_back_with_one_warning(
    inode_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING),
        InMemoryCheckpointManager(_cfg(memory_folder=str(inode_tmpfs / "lmr"))) as m,
    ):
        _use_up_inodes(inode_tmpfs)  # the folders and the lock exist; no slot file fits
        for s in (10, 20, 30):
            m.save(_state(s), s)
            m.maybe_wait()
        assert not m.survives_process
        assert _same(m.load(m.find_latest()), _state(30))  # training goes on
    warnings = [
        r.getMessage() for r in caplog.records if "LOST when this process" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "inodes" in warnings[0] and str(inode_tmpfs / "lmr") in warnings[0]


def test_no_inode_for_a_slot_is_memory_folder_full_when_memory_is_required(
    inode_tmpfs: Path,
) -> None:
    with InMemoryCheckpointManager(
        _cfg(memory_folder=str(inode_tmpfs / "lmr"), memory_required=True)
    ) as m:
        _use_up_inodes(inode_tmpfs)
        m.save(_state(10), 10)
        with pytest.raises(MemoryFolderFull, match="inodes"):
            m.maybe_wait()
        m.close(finished=False)


def test_no_inode_for_the_folders_falls_back_or_is_memory_folder_full(
    inode_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _use_up_inodes(inode_tmpfs)
    with pytest.raises(MemoryFolderFull, match="no room for the memory"):
        InMemoryCheckpointManager(_cfg(memory_folder=str(inode_tmpfs), memory_required=True))
    with (
        caplog.at_level(logging.WARNING),
        InMemoryCheckpointManager(_cfg(memory_folder=str(inode_tmpfs))) as m,
    ):
        assert not m.survives_process
        m.save(_state(1), 1)
        m.maybe_wait()
        assert _same(m.load(1), _state(1))
    assert "is unusable" in caplog.text and "inodes" in caplog.text


# -- item 8: memory slots are checksummed by default --------------------------------------


def test_a_flipped_byte_in_a_committed_slot_is_refused_at_reattach_by_default(
    _isolated_memory_folder: Path,
) -> None:
    _crash_after((10, 20))  # the default config: verify_integrity=False (disk shards only)
    p = _slot_with(_isolated_memory_folder, 20)
    with open(p, "r+b") as f:  # one data byte of the committed arena on /dev/shm
        f.seek(PAGE + 5)
        byte = f.read(1)
        f.seek(PAGE + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    with InMemoryCheckpointManager(_cfg()) as m:
        assert m.find_latest() == 20
        state = m.load()
        assert _same(state, _state(10))  # never the damaged bytes: the next source
        report = m.last_restore
        assert report.walked_back_from == [20]
        problems = " ".join(report.problems)
        assert "checksum_mismatch" in problems and str(p) in problems
        m.close(finished=False)


def test_a_slot_record_without_checksums_is_refused(_isolated_memory_folder: Path) -> None:
    _crash_after((10,))
    p = _slot_with(_isolated_memory_folder, 10)
    raw = bytearray(p.read_bytes())
    fmt = struct.Struct("<8sIIQqQQQI")
    fields = list(fmt.unpack_from(raw, 0))
    off, size = fields[6], fields[7]
    record = json.loads(bytes(raw[off : off + size]))
    record["integrity"] = None  # a well-formed record that simply carries no checksums
    blob = json.dumps(record, separators=(",", ":")).encode()
    fields[7], fields[8] = len(blob), crc32c.crc32c(blob)
    with open(p, "r+b") as f:
        f.seek(off)
        f.write(blob)
        f.seek(0)
        f.write(fmt.pack(*fields))
    with InMemoryCheckpointManager(_cfg()) as m:
        assert m.find_latest() == 10
        with pytest.raises(ResiliencyError, match="checksum_missing"):
            m.load()
        m.close(finished=False)


def test_checksums_are_computed_by_the_worker_and_sealed_into_the_record(
    _isolated_memory_folder: Path,
) -> None:
    with InMemoryCheckpointManager(_cfg()) as m:
        m.save(_state(3), 3)
        m.maybe_wait()
        m.wait_persisted()
        assert len(m.stats.crc_s) == 1  # measured on the worker, not in save/maybe_wait
        (slot,) = m._engine.complete_slots()
        assert slot.crcs is not None and len(slot.crcs) == 1
        p = _slot_with(_isolated_memory_folder, 3)
        raw = p.read_bytes()
        off, size = struct.unpack_from("<QQ", raw, 40)
        integrity = json.loads(raw[off : off + size])["integrity"]
        assert integrity["chunks"] == [f"{c:08x}" for c in slot.crcs]
        m.close(finished=False)


# -- smaller items: a lock or a root that is not ours ------------------------------------


def _rank_dir(folder: Path) -> Path:
    (d,) = folder.glob("run-*/topo-*/rank-0")
    return d


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused(
    _isolated_memory_folder: Path, kind: str
) -> None:
    _crash_after((10,))
    lock = _rank_dir(_isolated_memory_folder) / "lock"
    lock.unlink()
    if kind == "fifo":
        os.mkfifo(lock, 0o600)
    else:
        lock.mkdir(mode=0o700)
    with pytest.raises(UnsafePathError) as info:
        InMemoryCheckpointManager(_cfg())
    text = str(info.value)
    assert f"memory folder lock {lock}" in text
    assert ("a FIFO" if kind == "fifo" else "Is a directory") in text
    assert "remove it" in text and info.value.reason == "not_a_file"


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_a_memory_root_owned_by_another_user_is_refused(_isolated_memory_folder: Path) -> None:
    _isolated_memory_folder.mkdir(parents=True, mode=0o700)
    os.chown(_isolated_memory_folder, 65534, 65534)
    with pytest.raises(UnsafePathError) as info:
        InMemoryCheckpointManager(_cfg())
    text = str(info.value)
    assert str(_isolated_memory_folder) in text and "owned by nobody" in text
    assert "chown" in text and info.value.reason == "foreign_owner"

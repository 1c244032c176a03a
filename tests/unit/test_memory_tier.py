"""The memory tier in one process: slot files that a new manager re-attaches, and every bad
slot file ignored with its reason (nothing from it is ever applied)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.errors import ResiliencyError, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory import MemoryFolder, MemoryFolderFull, SlotFile
from lm_resiliency.memory import folder as folder_mod
from lm_resiliency.memory.slotfile import PAGE

torch.set_num_threads(1)
ROOT = os.geteuid() == 0


def _state(step: int, n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g).half()},
        "step": step,
        "data": {"offset": step * 8},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _cfg(**kw) -> InMemoryCkptConfig:
    base = {"run_id": "mem-test", "disk_flush_interval": 0, "signal_flush": False}
    return InMemoryCkptConfig(**{**base, **kw})


def _crash_after(steps: tuple[int, ...], **kw) -> None:
    """A manager that captured ``steps`` and left without finishing (as a crashed worker)."""
    m = InMemoryCheckpointManager(_cfg(**kw))
    for s in steps:
        m.save(_state(s), s)
        m.maybe_wait()
    m.close(finished=False)


def _slots(folder: Path) -> list[Path]:
    return sorted(folder.glob("run-*/topo-*/rank-0/*.slot"))


def _step_of(path: Path) -> int:
    return struct.unpack("<q", path.read_bytes()[24:32])[0]


_COMMITTED = 2


def _state_word(path: Path) -> int:
    return struct.unpack("<I", path.read_bytes()[12:16])[0]


def _file_with(folder: Path, step: int) -> Path:
    return next(p for p in _slots(folder) if _step_of(p) == step)


def test_a_new_manager_reattaches_the_committed_slots_and_restores_from_memory(
    _isolated_memory_folder: Path,
) -> None:
    _crash_after((10, 20))
    assert [p.name for p in _slots(_isolated_memory_folder)] == ["own-0.slot", "own-1.slot"]
    with InMemoryCheckpointManager(_cfg()) as m:
        assert m.survives_process
        assert m.find_latest() == 20
        state = m.load(20)
        assert _same(state, _state(20))
        assert m.last_restore.sources == ["own memory"]
        # the older capture is still there, from the other slot
        assert _same(m.load(10), _state(10))


def test_hand_over_keeps_the_step_in_a_fresh_file_that_the_next_capture_rotates(
    _isolated_memory_folder: Path,
) -> None:
    _crash_after((10,))
    with InMemoryCheckpointManager(_cfg()) as m:
        (handed,) = _slots(_isolated_memory_folder)
        handed_inode = handed.stat().st_ino
        state = m.load(m.find_latest())
        m.commit_restore()
        m.maybe_wait()  # the copy back into own memory is complete
        m.wait_persisted()  # and committed
        (kept,) = _slots(_isolated_memory_folder)
        assert kept.stat().st_ino != handed_inode  # a new file: the old one is the state now
        assert (_step_of(kept), _state_word(kept)) == (10, _COMMITTED)
        assert _same(state, _state(10))  # the caller's tensors stay valid
        assert [s.step for s in m.slots().values()] == [10, None]
        m.save(_state(15), 15)
        m.maybe_wait()
        m.wait_persisted()
        assert sorted(_step_of(p) for p in _slots(_isolated_memory_folder)) == [10, 15]
        assert {r: s.step for r, s in m.slots().items()} == {"own_current": 15, "own_previous": 10}
        assert _same(state, _state(10))  # and nothing wrote into them


def test_after_commit_restore_own_memory_holds_the_recovered_bytes_that_a_step_leaves_alone(
    _isolated_memory_folder: Path,
) -> None:
    """Adam's state aliases the handed-over arena; the kept slot is a copy of it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)  # 2 MiB weights: restored as views of the arena
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    first = InMemoryCheckpointManager(_cfg())
    for step in (5, 10):
        model(torch.randn(8, 512)).sum().backward()
        first.maybe_wait()
        opt.step()
        opt.zero_grad()
        first.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
    first.maybe_wait()
    reference = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    first.close(finished=False)  # a crash: both slots stay

    with InMemoryCheckpointManager(_cfg()) as m:
        assert m.find_latest() == 10
        state = m.load(10)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        live = opt.state_dict()["state"][0]["exp_avg"]
        m.commit_restore()
        model(torch.randn(8, 512)).sum().backward()
        m.maybe_wait()  # before the step changes the handed-over arena
        opt.step()
        assert not torch.equal(live, reference["exp_avg"])  # the step did write the arena
        m.wait_persisted()
        assert sorted(_step_of(p) for p in _slots(_isolated_memory_folder)) == [5, 10]
        assert m.stats.kept_copy_s and m.stats.kept_wait_s and not m.stats.wait_s
        m.close(finished=False)  # the whole job dies before its next capture

    with InMemoryCheckpointManager(_cfg()) as again:
        assert again.find_latest() == 10
        kept = again.load(10)
        assert again.last_restore.sources == ["own memory"]
        assert _same(kept["optim"]["state"][0], reference)
        assert _same(kept["model"], weights)


def test_without_a_memory_folder_nothing_is_kept_after_the_hand_over(tmp_path: Path) -> None:
    m = InMemoryCheckpointManager(_cfg(memory_folder=None))
    m.save(_state(10), 10)
    m.maybe_wait()
    state = m.load(10)
    m.commit_restore()  # process memory dies with the process: no copy is made
    m.maybe_wait()
    assert not m.survives_process and not m.stats.kept_copy_s
    assert [s.step for s in m.slots().values()] == [None, None]
    assert _same(state, _state(10))
    m.close()


def test_files_are_private_and_the_successful_close_removes_them(
    _isolated_memory_folder: Path,
) -> None:
    m = InMemoryCheckpointManager(_cfg())
    m.save(_state(5), 5)
    m.maybe_wait()
    (slot,) = _slots(_isolated_memory_folder)
    assert stat.S_IMODE(slot.stat().st_mode) == 0o600
    for d in (slot.parent, slot.parent.parent, slot.parent.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    m.close()  # a finished run
    assert list(_isolated_memory_folder.glob("run-*")) == []


def test_another_run_id_never_sees_the_slots(_isolated_memory_folder: Path) -> None:
    _crash_after((10,))
    with InMemoryCheckpointManager(_cfg(run_id="someone-else")) as other:
        assert other.find_latest() is None
        other.close(finished=False)
    with InMemoryCheckpointManager(_cfg()) as m:
        assert m.find_latest() == 10


def test_a_finished_run_is_not_resumed_unless_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"disk_folder": str(tmp_path / "disk"), "interval": 10, "disk_flush_interval": 10}
    m = InMemoryCheckpointManager(_cfg(**cfg))
    for s in (10, 20, 30):
        m.save(_state(s), s)
        m.maybe_wait()
    m.wait_persisted()
    m.close()  # finished: slots removed, the run marked finished on disk
    with caplog.at_level(logging.WARNING), InMemoryCheckpointManager(_cfg(**cfg)) as again:
        assert again.find_latest() is None
        again.close(finished=False)
    assert "finished at step 30" in caplog.text and "resume='finished'" in caplog.text
    with InMemoryCheckpointManager(_cfg(**cfg, resume="finished")) as resumed:
        assert resumed.find_latest() == 30
        assert _same(resumed.load(30), _state(30))
        assert resumed.last_restore.sources == ["own disk"]


def _magic(p: Path) -> None:
    _poke(p, 0, b"NOTASLOT")


def _version(p: Path) -> None:
    _poke(p, 8, struct.pack("<I", 99))


def _writing(p: Path) -> None:
    _poke(p, 12, struct.pack("<I", 1))


def _record_byte(p: Path) -> None:
    raw = p.read_bytes()
    off, size = struct.unpack("<QQ", raw[40:56])
    _poke(p, off + size // 2, bytes([raw[off + size // 2] ^ 0x20]))


def _truncated(p: Path) -> None:
    os.truncate(p, PAGE + 10)


def _symlink(p: Path) -> None:
    target = p.with_name("elsewhere")
    shutil.copy(p, target)
    p.unlink()
    p.symlink_to(target)


def _world_readable(p: Path) -> None:
    p.chmod(0o644)


def _hard_link(p: Path) -> None:
    os.link(p, p.with_name("second-name"))


def _foreign_owner(p: Path) -> None:
    os.chown(p, 65534, 65534)


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p, 0o600)


def _poke(p: Path, offset: int, data: bytes) -> None:
    with open(p, "r+b") as f:
        f.seek(offset)
        f.write(data)


_BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "wrong magic": (_magic, "bad_magic"),
    "newer version": (_version, "unsupported_version"),
    "still WRITING": (_writing, "not_committed"),
    "damaged record": (_record_byte, "record_checksum"),
    "truncated": (_truncated, "truncated"),
    "symlink": (_symlink, "symlink"),
    "readable by others": (_world_readable, "permissions"),
    "hard link": (_hard_link, "hard_link"),
    "FIFO": (_fifo, "not_a_file"),
    "another user's": (_foreign_owner, "foreign_owner"),
}


@pytest.mark.parametrize("mutation", sorted(_BAD))
def test_a_bad_slot_file_is_ignored_with_its_reason(
    mutation: str, _isolated_memory_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if mutation == "another user's" and not ROOT:
        pytest.skip("chown to another user needs root")
    _crash_after((10, 20))
    damage, reason = _BAD[mutation]
    damage(_file_with(_isolated_memory_folder, 20))
    # A half-written slot (not_committed) is routine after a crash: INFO, the rest WARNING.
    level = logging.INFO if reason == "not_committed" else logging.WARNING
    with caplog.at_level(level), InMemoryCheckpointManager(_cfg()) as m:
        assert m.find_latest() == 10  # the previous committed slot, never the bad one
        assert _same(m.load(10), _state(10))
        m.close(finished=False)
    assert f"({reason})" in caplog.text


def test_a_slot_of_another_run_copied_in_is_refused(_isolated_memory_folder: Path, caplog) -> None:
    _crash_after((10,), run_id="run-a")
    _crash_after((30,), run_id="run-b")
    a = _slots(_isolated_memory_folder)
    src = next(p for p in a if _step_of(p) == 30)
    dst = next(p for p in a if _step_of(p) == 10)
    shutil.copy(src, dst)  # run b's committed slot planted in run a's folder
    dst.chmod(0o600)
    with caplog.at_level(logging.WARNING), InMemoryCheckpointManager(_cfg(run_id="run-a")) as m:
        assert m.find_latest() is None
        m.close(finished=False)
    assert "(identity)" in caplog.text


def test_checksums_are_verified_before_a_reattached_slot_is_used(
    _isolated_memory_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _crash_after((10, 20), verify_integrity=True)
    p = _file_with(_isolated_memory_folder, 20)
    _poke(p, PAGE + 100, b"\xff\xff")  # a data byte: only the CRC can tell
    with (
        caplog.at_level(logging.WARNING),
        InMemoryCheckpointManager(_cfg(verify_integrity=True)) as m,
    ):
        assert m.find_latest() == 20  # listed: its record is intact
        state = m.load()
        assert _same(state, _state(10))  # walked back past the damaged bytes
        assert m.last_restore.walked_back_from == [20]
        assert "checksum_mismatch" in " ".join(m.last_restore.problems)
        m.close(finished=False)


def test_a_second_live_process_for_the_same_rank_is_refused(
    _isolated_memory_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(folder_mod, "MEMORY_LOCK_WAIT_S", 0.2)
    first = MemoryFolder(_isolated_memory_folder, run_id="r", topology="t" * 64, rank=0)
    try:
        with pytest.raises(ResiliencyError, match=r"in use by another live process \(pid \d+\)"):
            MemoryFolder(_isolated_memory_folder, run_id="r", topology="t" * 64, rank=0)
    finally:
        first.close()
    MemoryFolder(_isolated_memory_folder, run_id="r", topology="t" * 64, rank=0).close()


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_a_run_folder_planted_by_another_user_is_refused(_isolated_memory_folder: Path) -> None:
    _crash_after((10,))
    (run,) = _isolated_memory_folder.glob("run-*")
    os.chown(run, 65534, 65534)  # someone else's directory now sits where ours was
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        InMemoryCheckpointManager(_cfg())


def test_a_memory_folder_others_can_write_is_refused(_isolated_memory_folder: Path) -> None:
    _isolated_memory_folder.mkdir(parents=True)
    _isolated_memory_folder.chmod(0o777)  # no sticky bit: anyone could swap our folders
    with pytest.raises(UnsafePathError, match="writable"):
        InMemoryCheckpointManager(_cfg())


def test_superseded_topologies_of_the_run_are_removed(_isolated_memory_folder: Path) -> None:
    old = MemoryFolder(_isolated_memory_folder, run_id="r", topology="o" * 64, rank=0)
    old_path = old.path
    old.close()  # no live process holds it
    busy = MemoryFolder(_isolated_memory_folder, run_id="r", topology="b" * 64, rank=1)
    mine = MemoryFolder(_isolated_memory_folder, run_id="r", topology="n" * 64, rank=0)
    try:
        removed = mine.remove_superseded_topologies()
        assert removed == [old_path.parent.name]
        assert not old_path.exists() and busy.path.exists()
    finally:
        busy.close()
        mine.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small-shm"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=False
    )
    if done.returncode != 0:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_too_small_tmpfs_falls_back_to_process_memory_with_one_warning(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING),
        InMemoryCheckpointManager(_cfg(memory_folder=str(small_tmpfs / "lmr"))) as m,
    ):
        for s in (10, 20, 30):  # two own slots of 800 KB each cannot fit in 1 MiB
            m.save(_state(s, n=200_000), s)
            m.maybe_wait()
        assert not m.survives_process
        assert _same(m.load(m.find_latest()), _state(30, n=200_000))  # training goes on
    warnings = [r for r in caplog.records if "memory slots of" in r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert str(small_tmpfs / "lmr") in text and "LOST when this process dies" in text
    assert "--shm-size" in text and "memory_folder=None" in text


def test_a_too_small_tmpfs_is_an_error_when_memory_is_required(small_tmpfs: Path) -> None:
    with InMemoryCheckpointManager(
        _cfg(memory_folder=str(small_tmpfs / "lmr"), memory_required=True)
    ) as m:
        with pytest.raises(MemoryFolderFull) as info:
            m.save(_state(10, n=200_000), 10)
        m.close(finished=False)
    text = str(info.value)
    assert str(small_tmpfs / "lmr") in text and "bytes" in text and "--shm-size" in text


def test_reserving_a_slot_on_a_full_tmpfs_is_a_clear_error_not_sigbus(small_tmpfs: Path) -> None:
    folder = small_tmpfs / "x"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(MemoryFolderFull, match="no room for a"):
            SlotFile.create(fd, "own-0.slot", 4 << 20, where=str(folder / "own-0.slot"))
        assert os.listdir(fd) == []  # the temp file is gone too
    finally:
        os.close(fd)


def test_recovery_says_what_it_did_in_one_info_line(
    _isolated_memory_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _crash_after((10, 20))
    with caplog.at_level(logging.INFO), InMemoryCheckpointManager(_cfg()) as m:
        m.load(m.find_latest())
        m.close(finished=False)
    lines = [r.getMessage() for r in caplog.records if "GEMINI recovered" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("GEMINI recovered step 20 (own memory on ranks")


def test_a_restarted_job_that_recovers_nothing_warns_without_any_logging_setup(
    tmp_path: Path,
) -> None:
    code = (
        "from lm_resiliency import InMemoryCkptConfig\n"
        "from lm_resiliency.experimental import InMemoryCheckpointManager\n"
        f"cfg = InMemoryCkptConfig(run_id='r', disk_folder={str(tmp_path)!r})\n"
        "m = InMemoryCheckpointManager(cfg)\n"
        "assert m.find_latest() is None\n"
        "m.close(finished=False)\n"
    )
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "GEMINI recovers nothing" in ln]
    assert "no step is available on every rank" in line and "rank 0: none" in line


def test_a_state_changed_before_commit_restore_is_not_kept_as_the_recovered_step(
    _isolated_memory_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    param = torch.nn.Parameter(torch.randn(1 << 19))  # 2 MiB: Adam's state aliases the arena
    opt = torch.optim.Adam([param])
    first = InMemoryCheckpointManager(_cfg())
    for step in (5, 10):
        param.grad = torch.randn_like(param)
        opt.step()
        first.save({"optim": opt.state_dict()}, step)
        first.maybe_wait()
    first.close(finished=False)
    with InMemoryCheckpointManager(_cfg()) as m, caplog.at_level(logging.WARNING):
        opt.load_state_dict(m.load(10)["optim"])
        opt.step()  # before commit_restore(): the handed-over bytes are no longer step 10
        m.commit_restore()
        m.maybe_wait()
        m.wait_persisted()
        committed = [p for p in _slots(_isolated_memory_folder) if _state_word(p) == _COMMITTED]
        assert [_step_of(p) for p in committed] == [5]  # the copy's file stays, uncommitted
        assert [s.step for s in m.slots().values()] == [None, 5]
        assert "changed before commit_restore()" in caplog.text

"""``inspect`` and ``clean`` on hostile folders: one problem line each, never a traceback,
and ``inspect --verify`` refuses exactly what recovery refuses."""

from __future__ import annotations

import logging
import os
import struct
import sys
import tempfile
from pathlib import Path

import crc32c
import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture import Layout
from lm_resiliency.cli.main import main
from lm_resiliency.errors import IdentityMismatch, UnsafePathError
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory import MemoryFolder
from lm_resiliency.memory.slotfile import read_record
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.recovery.fetch import decode
from lm_resiliency.recovery.sources import Material
from lm_resiliency.state import encode_state

torch.set_num_threads(1)
ROOT = os.geteuid() == 0
_PREFIX = struct.Struct("<8sIIQqQQQI")


def _cfg(tmp: Path, **kw) -> InMemoryCkptConfig:
    base = {"run_id": "hostile", "disk_folder": str(tmp / "disk"), "signal_flush": False}
    return InMemoryCkptConfig(**{**base, "disk_flush_interval": 0, **kw})


def _state(step: int) -> dict:
    return {"w": torch.full((512,), float(step)), "step": step}


def _crash_after(tmp: Path, steps: tuple[int, ...] = (10, 20)) -> None:
    m = InMemoryCheckpointManager(_cfg(tmp))
    for s in steps:
        m.save(_state(s), s)
        m.maybe_wait()
    m.close(finished=False)


def _slot(memory: Path, step: int) -> Path:
    return next(
        p
        for p in memory.glob("run-*/topo-*/rank-0/*.slot")
        if struct.unpack("<q", p.read_bytes()[24:32])[0] == step
    )


def _inspect(tmp: Path, memory: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    (tmp / "disk").mkdir(exist_ok=True)
    code = main(["inspect", str(tmp / "disk"), "--memory-folder", str(memory), *extra])
    out = capsys.readouterr().out
    return code, [ln for ln in out.splitlines() if ln.startswith("problem: ")]


def _record(path: Path, blob: bytes, *, offset: int | None = None) -> None:
    """Replace the commit record of ``path`` by ``blob`` (its CRC made to match)."""
    raw = bytearray(path.read_bytes())
    fields = list(_PREFIX.unpack_from(raw, 0))
    off = fields[6] if offset is None else offset
    fields[6], fields[7], fields[8] = off, len(blob), crc32c.crc32c(blob)
    _PREFIX.pack_into(raw, 0, *fields)
    if offset is None:
        raw[off:] = blob
    path.write_bytes(bytes(raw))


# -- item 9: hostile memory folders -----------------------------------------------------


def _list_record(p: Path) -> None:
    _record(p, b"[1, 2, 3]")


def _deep_record(p: Path) -> None:
    _record(p, b"[" * 200_000 + b"]" * 200_000)


def _huge_offset(p: Path) -> None:
    _record(p, b"{}", offset=2**63 + 5)


_HOSTILE_SLOTS = {
    "a commit record that is a JSON list": (_list_record, "malformed_record"),
    "a deeply nested record": (_deep_record, "malformed_record"),
    "a record offset >= 2**63": (_huge_offset, "malformed_record"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_SLOTS))
def test_a_hostile_slot_is_one_problem_line_for_inspect_and_is_cleaned(
    case: str, tmp_path: Path, _isolated_memory_folder: Path, capsys
) -> None:
    _crash_after(tmp_path)
    damage, reason = _HOSTILE_SLOTS[case]
    bad = _slot(_isolated_memory_folder, 20)
    damage(bad)
    code, problems = _inspect(tmp_path, _isolated_memory_folder, capsys)
    assert code == 1
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"problem: memory slot {bad} is unusable ({reason}): ")
    mem = str(_isolated_memory_folder)
    assert main(["clean", "--stale", "--memory-folder", mem]) == 0  # a damaged slot is junk
    assert not bad.exists()


def test_a_file_named_like_a_rank_folder_and_a_bad_rank_name_are_problems(
    tmp_path: Path, _isolated_memory_folder: Path, capsys
) -> None:
    _crash_after(tmp_path)
    (topo,) = _isolated_memory_folder.glob("run-*/topo-*")
    (topo / "rank-7").write_bytes(b"not a folder")
    (topo / "rank-x").mkdir(mode=0o700)
    code, problems = _inspect(tmp_path, _isolated_memory_folder, capsys)
    assert code == 1
    assert problems == [
        f"problem: {topo / 'rank-7'} (file): not a rank folder of the memory tier "
        "(rank-<N>/); left alone",
        f"problem: {topo / 'rank-x'} (dir): not a rank folder of the memory tier "
        "(rank-<N>/); left alone",
    ]
    before = sorted(_isolated_memory_folder.rglob("*"))
    assert main(["clean", "--stale", "--memory-folder", str(_isolated_memory_folder)]) == 1
    out = capsys.readouterr().out
    after = sorted(_isolated_memory_folder.rglob("*"))
    assert (topo / "rank-7").is_file() and (topo / "rank-x").is_dir() and topo.is_dir()
    assert not (topo / "rank-0").exists()  # the real rank folder went
    assert set(before) - set(after) == {p for p in before if "rank-0" in p.parts}
    assert "left alone" in out


def _as_nobody(argv: list[str], out: Path) -> int:
    """Run ``lm-resiliency ARGV`` in a child whose effective user is ``nobody``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            sys.stdout = sys.stderr = open(fd, "w", closefd=False)  # noqa: SIM115
            os.setegid(65534)
            os.seteuid(65534)
            code = main(argv)
        except BaseException as exc:  # a traceback would be the defect: report it
            os.write(fd, f"CRASH {type(exc).__name__}: {exc}\n".encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_clean_and_inspect_as_another_user_say_so_in_one_line(
    tmp_path: Path, _isolated_memory_folder: Path, capsys
) -> None:
    _crash_after(tmp_path)
    mem = str(_isolated_memory_folder)
    before = sorted(_isolated_memory_folder.rglob("*"))
    out = tmp_path / "out.txt"
    if ROOT:
        code = _as_nobody(["clean", "--stale", "--memory-folder", mem], out)
        text = out.read_text()
    else:
        _isolated_memory_folder.chmod(0)
        try:
            code = main(["clean", "--stale", "--memory-folder", mem])
        finally:
            _isolated_memory_folder.chmod(0o700)
        text = capsys.readouterr().err
    assert code == 2, text
    assert text == (
        f"lm-resiliency clean: error: cannot read {mem}: Permission denied; nothing was removed\n"
    )
    assert sorted(_isolated_memory_folder.rglob("*")) == before
    if ROOT:
        disk = Path(tempfile.mkdtemp(prefix="lmr-disk-"))  # one nobody may read
        try:
            disk.chmod(0o755)
            code = _as_nobody(["inspect", str(disk), "--memory-folder", mem], out)
        finally:
            disk.rmdir()
        assert code == 2, out.read_text()
        assert f"problem: cannot read {mem}: Permission denied" in out.read_text()


# -- item 10: inspect --verify refuses what recovery refuses ----------------------------


def test_a_slot_readable_by_others_is_refused_by_both(
    tmp_path: Path, _isolated_memory_folder: Path, capsys, caplog
) -> None:
    _crash_after(tmp_path)
    bad = _slot(_isolated_memory_folder, 20)
    bad.chmod(0o644)
    code, problems = _inspect(tmp_path, _isolated_memory_folder, capsys, "--verify")
    assert code == 1
    assert problems == [
        f"problem: memory slot {bad} is unusable (permissions): mode 644 is not private (0600)"
    ]
    with caplog.at_level(logging.WARNING), InMemoryCheckpointManager(_cfg(tmp_path)) as m:
        assert m.find_latest() == 10  # recovery refuses the same slot
        m.close(finished=False)
    assert f"memory slot {bad} is unusable (permissions)" in caplog.text


@pytest.mark.parametrize("change", ["mode 0777", "another user's"])
def test_an_unsafe_rank_folder_is_refused_by_both(
    change: str, tmp_path: Path, _isolated_memory_folder: Path, capsys
) -> None:
    if change == "another user's" and not ROOT:
        pytest.skip("chown to another user needs root")
    _crash_after(tmp_path)
    (rank,) = _isolated_memory_folder.glob("run-*/topo-*/rank-0")
    topology = _topology_of(_slot(_isolated_memory_folder, 20))
    if change == "mode 0777":
        rank.chmod(0o777)
        reason = "writable by group or others"
    else:
        os.chown(rank, 65534, 65534)
        reason = "is owned by"
    code, problems = _inspect(tmp_path, _isolated_memory_folder, capsys, "--verify")
    assert code == 1
    assert len(problems) == 1 and str(rank) in problems[0] and reason in problems[0]
    with pytest.raises(UnsafePathError, match=reason):  # the memory tier refuses it too
        MemoryFolder(_isolated_memory_folder, run_id="hostile", topology=topology, rank=0)


def _topology_of(slot: Path) -> str:
    fd = os.open(slot, os.O_RDONLY)
    try:
        return read_record(fd, str(slot))[0].identity.topology
    finally:
        os.close(fd)


def test_a_foreign_run_manifest_is_refused_by_both(tmp_path: Path, capsys) -> None:
    layout = Layout.from_tensors([torch.ones(8)], ["w"])
    doc = encode_state({"w": torch.ones(8)}).document
    store = ShardStore(tmp_path, run_id="mine", topology="t" * 64, rank=0, verify_integrity=True)
    store.write(owner_rank=0, step=1, layout=layout, arena=torch.ones(32, dtype=torch.uint8),
                state_document=doc)  # fmt: skip
    store.close()
    manifest = tmp_path / ns.run_dir("mine") / ns.RUN_MANIFEST
    manifest.write_text('{"kind": "lm_resiliency.run", "version": 1, "run_id": "theirs"}\n')
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        f"problem: {manifest} names run_id='theirs', not the identity of its directory "
        f"{ns.run_dir('mine')}" in out
    )
    with pytest.raises(IdentityMismatch, match="names run_id='theirs'"):
        ShardStore(tmp_path, run_id="mine", topology="t" * 64, rank=0, verify_integrity=True)


def test_a_schema_invalid_state_document_is_refused_by_both(tmp_path: Path, capsys) -> None:
    layout = Layout.from_tensors([torch.ones(8)], ["w"])
    arena = torch.ones(32, dtype=torch.uint8)
    bad_doc = {"schema": "lm_resiliency.state/1", "tensor_count": 1, "root": {"k": "nope"}}
    store = ShardStore(tmp_path, run_id="doc", topology="d" * 64, rank=0, verify_integrity=True)
    store.write(owner_rank=0, step=1, layout=layout, arena=arena, state_document=bad_doc)
    code = main(["inspect", "--verify", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"problem: shard {store.path_for(0, 1)} is unavailable (schema): its state " in out
    # Recovery's own path: the disk source's material, then recovery's decode.
    shard = store.read(owner_rank=0, step=1)
    with pytest.raises(Exception, match="invalid state document") as info:
        decode(Material(shard.layout, shard.arena, shard.state_document))
    assert type(info.value).__name__ == "StateSchemaError"
    store.close()


def test_a_sound_folder_still_verifies(tmp_path: Path, _isolated_memory_folder: Path, capsys):
    m = InMemoryCheckpointManager(_cfg(tmp_path, disk_flush_interval=10, verify_integrity=True))
    for s in (10, 20):
        m.save(_state(s), s)
        m.maybe_wait()
    m.wait_persisted()
    m.close(finished=False)
    code, problems = _inspect(tmp_path, _isolated_memory_folder, capsys, "--verify")
    assert (code, problems) == (0, [])
    assert main(["inspect", "--verify", str(tmp_path / "disk"), "--memory-folder",
                 str(_isolated_memory_folder)]) == 0  # fmt: skip
    assert capsys.readouterr().out.count("COMMITTED, CRC verified") == 2

"""What a memory folder holds: runs, topologies, ranks and their slot files, judged as
recovery judges them.

Read-only and safe on a live folder: nothing is created or modified, and no link
is followed. Every directory is entered with the same checks the memory tier
applies before it uses one (:func:`~lm_resiliency._safefs.open_subdir`:
never a link, another user's or a group/other-writable directory), and every slot
file is validated by the memory tier's own reader
(:func:`~lm_resiliency.memory.slotfile.read_record`: kind, owner, mode, links,
prefix, record CRC, schema, layout, state document), then its identity is checked
against where it lies (run and topology names, rank folder, own/held role). With
``verify=True`` the arena's CRC-32C values are checked as at a restart
(:meth:`~lm_resiliency.memory.slotfile.SlotFile.verify`), for ranks no live
process holds. A rank folder is *live* while a process holds its ``lock``.

Nothing found here raises: every entry that is not what the memory tier would
write or accept is a one-line problem of the level that holds it. A folder that
holds what only a *disk* checkpoint folder holds (``run.json``, ``step-<N>``,
...) is noted in :attr:`MemoryScan.disk_markers`, so ``clean`` never mistakes one
for the other. Used by ``lm-resiliency inspect`` and ``lm-resiliency clean``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm_resiliency._safefs import entry_kind, open_root, open_subdir
from lm_resiliency._tempnames import TempName
from lm_resiliency.errors import UnsafePathError
from lm_resiliency.memory.folder import LINEAGE_FILE, LOCK_FILE
from lm_resiliency.memory.slotfile import (
    SlotFile,
    SlotIdentity,
    SlotReason,
    SlotUnavailable,
    read_record,
)
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.lockprobe import UnknownLock, holder_pid, lock_is_held

_RANK_RE = re.compile(r"rank-(0|[1-9][0-9]{0,9})")
#: The slot files recovery opens (``folder.slot_file_name`` of the tier's slot names).
_SLOT_RE = re.compile(r"(own|held)-[01]\.slot")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class SlotInfo:
    """One slot file: its role, step and state (``problem``: why recovery would refuse it)."""

    name: str
    path: str
    size_bytes: int
    state: str = "?"
    step: int | None = None
    owner_rank: int | None = None
    run_id: str | None = None
    checksums: bool | None = None
    verified_crc: bool = False
    problem: str | None = None
    """A :class:`~lm_resiliency.memory.slotfile.SlotReason` value, or ``None`` (usable)."""
    detail: str | None = None


@dataclass
class RankFolder:
    """One rank folder. ``files``: its other entries a clean may remove (lock last);
    ``problems``: entries that make it unsafe to judge or remove (one line each)."""

    rank: int
    path: str
    live: bool
    holder: str | None = None
    slots: list[SlotInfo] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.slots)


@dataclass
class MemoryRun:
    """One run folder; ``problems`` are its (and its topology folders') unsafe or unknown
    entries, ``topologies`` the paths of its topology folders."""

    name: str
    path: str
    run_id: str | None
    topologies: list[str] = field(default_factory=list)
    ranks: list[RankFolder] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    kept_dirs: set[str] = field(default_factory=set)
    """Folders that hold an entry left alone (so they are never removed)."""

    @property
    def live(self) -> bool:
        return any(r.live for r in self.ranks)


@dataclass
class MemoryScan:
    """Everything :func:`scan_memory` found; ``error``: the folder itself cannot be read."""

    folder: str
    runs: list[MemoryRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    disk_markers: list[str] = field(default_factory=list)
    """Entries only a disk checkpoint folder holds: this is not a memory folder."""
    error: str | None = None

    def all_problems(self) -> list[str]:
        """One line per refused slot and per unsafe or unknown entry (empty: sound)."""
        out = list(self.problems)
        for run in self.runs:
            out += run.problems
            for rank in run.ranks:
                out += rank.problems
                out += [str(s.detail) for s in rank.slots if s.problem is not None]
        return out


def scan_memory(folder: str | Path, *, verify: bool = False) -> MemoryScan:
    """Describe every run under the memory folder ``folder`` (sorted by name).

    Never raises for what the folder holds; a folder that is absent is empty.
    """
    root = Path(folder)
    scan = MemoryScan(str(folder))
    try:
        root_fd = open_root(root)
    except FileNotFoundError:
        return scan
    except (OSError, UnsafePathError) as exc:
        scan.error = f"cannot read {root}: {_why(exc)}"
        return scan
    try:
        for name in _listdir(root_fd, str(root), scan.problems):
            where = root / name
            if ns.is_run_dir(name):
                sub = _enter(root_fd, name, where, scan.problems)
                if sub is not None:
                    with _closing(sub):
                        scan.runs.append(_scan_run(sub, where, verify, scan))
            elif name.endswith(".tmp") or entry_kind(root_fd, name) is None:
                continue
            else:
                scan.problems.append(f"{where}: not an entry the memory tier writes; left alone")
    finally:
        os.close(root_fd)
    return scan


def _why(exc: BaseException) -> str:
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)


@contextlib.contextmanager
def _closing(fd: int) -> Any:
    try:
        yield fd
    finally:
        os.close(fd)


def _listdir(fd: int, where: str, problems: list[str]) -> list[str]:
    try:
        return sorted(os.listdir(fd))
    except OSError as exc:
        problems.append(f"{where} cannot be listed: {_why(exc)}")
        return []


def _enter(dir_fd: int, name: str, where: Path, problems: list[str]) -> int | None:
    """Open a subdirectory with the memory tier's own checks, or note why not."""
    try:
        return open_subdir(dir_fd, name, create=False, where=str(where))
    except FileNotFoundError:
        return None
    except UnsafePathError as exc:
        problems.append(str(exc))
    except OSError as exc:
        problems.append(f"{where} cannot be opened: {_why(exc)}")
    return None


def _is_disk_entry(name: str) -> bool:
    return (
        name in (ns.RUN_MANIFEST, ns.TOPOLOGY_MANIFEST)
        or ns.parse_step_dir(name) is not None
        or ns.parse_sidecar_file(name) is not None
        or ns.parse_shard_file(name) is not None
        or name.startswith("lineage-rank-")
    )


def _scan_run(run_fd: int, where: Path, verify: bool, scan: MemoryScan) -> MemoryRun:
    run = MemoryRun(where.name, str(where), None)
    names = _listdir(run_fd, str(where), run.problems)
    if run.problems:
        run.kept_dirs.add(str(where))
    for topo in names:
        path = where / topo
        if _is_disk_entry(topo):
            scan.disk_markers.append(str(path))
        elif not ns.is_topology_dir(topo):
            run.problems.append(f"{path}: not an entry the memory tier writes; left alone")
            run.kept_dirs.add(str(where))
            continue
        else:
            run.topologies.append(str(path))
            topo_fd = _enter(run_fd, topo, path, run.problems)
            if topo_fd is None:
                run.kept_dirs |= {str(where), str(path)}
            else:
                with _closing(topo_fd):
                    _scan_topology(topo_fd, path, run, verify, scan)
    run.run_id = next((s.run_id for r in run.ranks for s in r.slots if s.run_id), None)
    return run


def _scan_topology(
    topo_fd: int, where: Path, run: MemoryRun, verify: bool, scan: MemoryScan
) -> None:
    before = len(run.problems)
    names = _listdir(topo_fd, str(where), run.problems)
    if len(run.problems) > before:
        run.kept_dirs.add(str(where))
    for name in names:
        path = where / name
        match = _RANK_RE.fullmatch(name)
        if _is_disk_entry(name):
            scan.disk_markers.append(str(path))
        elif match is None or entry_kind(topo_fd, name) != "dir":
            kind = entry_kind(topo_fd, name)
            run.problems.append(
                f"{path} ({kind}): not a rank folder of the memory tier (rank-<N>/); left alone"
            )
            run.kept_dirs.add(str(where))
        else:
            rank_fd = _enter(topo_fd, name, path, run.problems)
            if rank_fd is None:
                run.kept_dirs |= {str(where), str(path)}
            else:
                with _closing(rank_fd):
                    run.ranks.append(_scan_rank(rank_fd, path, int(match[1]), verify, scan))


def _scan_rank(rank_fd: int, where: Path, rank: int, verify: bool, scan: MemoryScan) -> RankFolder:
    info = RankFolder(rank, str(where), live=False)
    held: bool | None = None
    try:
        held = lock_is_held(rank_fd, LOCK_FILE, where=str(where / LOCK_FILE))
    except UnknownLock as exc:
        info.live = True  # cannot tell: treated as held by whoever uses it
        info.problems.append(str(exc))
    else:
        info.live = bool(held)
        if held:
            info.holder = holder_pid(rank_fd, LOCK_FILE)
    for name in _listdir(rank_fd, str(where), info.problems):
        path = where / name
        temp = TempName.parse(name)
        if name.endswith(".slot"):
            info.slots.append(_slot(rank_fd, name, path, rank, verify and not info.live))
        elif name in (LINEAGE_FILE, LOCK_FILE) or (temp is not None and _known(temp.target)):
            if name != LOCK_FILE:
                info.files.append(str(path))
        elif _is_disk_entry(name):
            scan.disk_markers.append(str(path))
        else:
            info.problems.append(f"{path}: not an entry the memory tier writes; left alone")
    if held is not None:
        info.files.append(str(where / LOCK_FILE))  # removed last
    return info


def _known(target: str) -> bool:
    return target == LINEAGE_FILE or target.endswith(".slot")


def _slot(rank_fd: int, name: str, path: Path, rank: int, verify: bool) -> SlotInfo:
    try:
        size = os.stat(name, dir_fd=rank_fd, follow_symlinks=False).st_size
    except OSError:
        size = 0
    info = SlotInfo(name, str(path), size)
    try:
        identity = _judge(rank_fd, name, path, rank, info)
        if verify and identity is not None:
            _verify(rank_fd, name, path, identity, info)
    except SlotUnavailable as exc:
        info.problem, info.detail = exc.reason, str(exc)
    except OSError as exc:
        info.problem = "io_error"
        info.detail = f"memory slot {path} cannot be read: {_why(exc)}"
    return info


def _judge(rank_fd: int, name: str, path: Path, rank: int, info: SlotInfo) -> SlotIdentity | None:
    """Validate with the memory tier's reader, then check the identity against the place."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=rank_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SlotUnavailable(
                SlotReason.SYMLINK, str(path), "a symlink; never followed"
            ) from None
        raise
    try:
        record, _ = read_record(fd, str(path))
    finally:
        os.close(fd)
    found = record.identity
    info.state, info.step, info.owner_rank = "COMMITTED", record.step, found.owner_rank
    info.run_id, info.checksums = found.run_id, record.crcs is not None
    role = name.split("-", 1)[0]
    run_name, topo_name = path.parent.parent.parent.name, path.parent.parent.name
    expected = SlotIdentity(
        found.run_id if ns.run_dir(found.run_id) == run_name else "<this run folder's>",
        found.topology if ns.topology_dir(found.topology) == topo_name else "<this topology's>",
        rank,
        rank if role == "own" else found.owner_rank,
        role,
    )
    if (
        _SLOT_RE.fullmatch(name) is None
        or found != expected
        or (role == "held" and found.owner_rank == rank)
    ):
        raise SlotUnavailable(
            SlotReason.IDENTITY,
            str(path),
            f"it records {found}, which recovery never looks for at this place "
            f"({run_name}/{topo_name}/rank-{rank}/{name})",
        )
    return expected


def _verify(rank_fd: int, name: str, path: Path, identity: SlotIdentity, info: SlotInfo) -> None:
    file, record = SlotFile.open_existing(rank_fd, name, identity, where=str(path))
    try:
        file.verify(record, required=False)
    finally:
        file.release()
    info.verified_crc = record.crcs is not None


def to_json(scan: MemoryScan) -> dict[str, Any]:
    """Plain JSON-ready dict of :func:`scan_memory`'s result."""
    doc = asdict(scan)
    doc["runs"] = [
        {**asdict(r), "kept_dirs": sorted(r.kept_dirs), "live": r.live} for r in scan.runs
    ]
    return doc

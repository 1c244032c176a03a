"""What ``lm-resiliency clean`` removes: an exact list of paths, decided before anything goes.

The plan is made once, from a read-only look at the folders. The dry run prints
it; the real run removes exactly its paths, file by file and folder by folder
(``unlink`` and ``rmdir``, never a recursive delete), each memory rank folder
while holding its lock so that a process starting meanwhile waits instead of
losing its files. Kept, with a line saying why:

* a memory rank folder whose ``lock`` a live process holds (or whose lock cannot
  be judged), or that holds an entry the memory tier never writes;
* a disk run folder of a run that is live: a rank folder of that run in the
  memory folder is held, a lock file of the disk namespace (``lock`` or
  ``*.lock`` in the run folder or a topology folder) is held, or a temp file of a
  live writer (or of another host, which cannot be judged) is there;
* a folder that is not the kind it was given as: a memory folder that holds
  disk-checkpoint entries (``run.json``, ``step-<N>``, ...), or a disk folder
  whose run folder has no ``run.json`` naming the run or holds rank folders of
  the memory tier. Then nothing at all is removed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lm_resiliency._safefs import open_root, open_subdir
from lm_resiliency._tempnames import TempName, TempScope, pid_alive
from lm_resiliency.errors import UnsafePathError
from lm_resiliency.memory.folder import LOCK_FILE
from lm_resiliency.memory.scan import MemoryRun, MemoryScan
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.lockprobe import UnknownLock, lock_is_held

_RUN_KIND = "lm_resiliency.run"


class WrongKind(Exception):
    """A folder is not the kind it was given as; the message says what it is and the fix."""


@dataclass
class Step:
    """Paths removed together (files first, then folders, deepest first) while the
    ``locks`` (folder, lock name) are held."""

    paths: list[str]
    locks: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    slot_bytes: int = 0
    file_bytes: int = 0

    @property
    def paths(self) -> list[str]:
        return [p for s in self.steps for p in s.paths]


def memory_plan(scan: MemoryScan, runs: list[MemoryRun], plan: Plan) -> None:
    """Add the removable rank folders of ``runs`` (and the folders they empty) to ``plan``."""
    if scan.disk_markers:
        raise WrongKind(
            f"{scan.folder} is not a memory folder: it holds {scan.disk_markers[0]}, which "
            "only a disk checkpoint folder (disk_folder) holds. Pass --memory-folder the "
            "memory_folder of the config, and the disk folder as --disk-folder with --run RUN_ID"
        )
    for run in runs:
        removed: set[str] = set()
        for rank in run.ranks:
            if rank.live:
                pid = f" (pid {rank.holder})" if rank.holder else ""
                why = rank.problems[0] if rank.problems else f"a live process holds it{pid}"
                plan.kept.append(f"kept {rank.path}: {why}")
            elif rank.problems:
                plan.kept.append(f"kept {rank.path}: {rank.problems[0]}")
            else:
                files = [s.path for s in rank.slots] + rank.files
                locks = [(rank.path, LOCK_FILE)] if rank.files[-1:] == [_lock(rank.path)] else []
                plan.steps.append(Step([*files, rank.path], locks))
                plan.slot_bytes += rank.size_bytes
                removed.add(rank.path)
        topo_gone = []
        for topo in run.topologies:
            mine = [r.path for r in run.ranks if str(Path(r.path).parent) == topo]
            if topo not in run.kept_dirs and all(p in removed for p in mine):
                topo_gone.append(topo)
        if topo_gone:
            plan.steps.append(Step(topo_gone))
        if run.path not in run.kept_dirs and len(topo_gone) == len(run.topologies):
            plan.steps.append(Step([run.path]))
        for line in run.problems:
            plan.kept.append(f"kept: {line}")


def _lock(rank_path: str) -> str:
    return str(Path(rank_path) / LOCK_FILE)


def disk_plan(folder: str, run_id: str, memory: MemoryRun | None, plan: Plan) -> None:
    """Add run ``run_id``'s node-local files in ``folder`` to ``plan`` unless the run is live.

    Raises :class:`WrongKind` when ``folder`` is not a disk checkpoint folder of that
    run, and ``OSError`` / ``UnsafePathError`` when it cannot be read safely.
    """
    root = Path(folder)
    name = ns.run_dir(run_id)
    where = root / name
    try:
        root_fd = open_root(root)
    except FileNotFoundError:
        return
    try:
        try:
            run_fd = open_subdir(root_fd, name, create=False, where=str(where))
        except FileNotFoundError:
            return
    finally:
        os.close(root_fd)
    try:
        _check_kind(run_fd, where, run_id)
        if memory is not None and memory.live:
            held = next(r for r in memory.ranks if r.live)
            plan.kept.append(
                f"kept {where}: run {run_id!r} is live (a process holds its memory rank "
                f"folder {held.path})"
            )
            return
        walk = _Walk(TempScope.current())
        walk.dir(run_fd, where, top=True)
    finally:
        os.close(run_fd)
    if walk.live:
        plan.kept += [f"kept {where}: {why}" for why in walk.live]
        return
    plan.kept += walk.kept
    plan.steps.append(Step(walk.files + walk.dirs, walk.locks))
    plan.file_bytes += walk.nbytes


def _check_kind(run_fd: int, where: Path, run_id: str) -> None:
    doc = ns.read_manifest(run_fd, ns.RUN_MANIFEST, where=str(where / ns.RUN_MANIFEST))
    if doc is None or doc.get("kind") != _RUN_KIND or doc.get("run_id") != run_id:
        names = "nothing readable" if doc is None else f"run_id={doc.get('run_id')!r}"
        raise WrongKind(
            f"{where} is not the disk checkpoint folder of run {run_id!r}: its "
            f"{ns.RUN_MANIFEST} names {names}. Nothing was removed; check --disk-folder "
            "(the disk_folder of the config) and --run"
        )
    for topo in os.listdir(run_fd):
        if not ns.is_topology_dir(topo):
            continue
        try:
            inside = os.listdir(os.path.join(where, topo))
        except OSError:
            continue
        rank = next((n for n in inside if n.startswith("rank-")), None)
        if rank is not None:
            raise WrongKind(
                f"{where} holds {where / topo / rank}, a rank folder of the memory tier: it is "
                "a memory folder, not a disk checkpoint folder. Pass it as --memory-folder"
            )


class _Walk:
    """Every entry of a disk run folder, deepest first; what makes it live or kept."""

    def __init__(self, scope: TempScope) -> None:
        self.scope = scope
        self.files: list[str] = []
        self.dirs: list[str] = []
        self.locks: list[tuple[str, str]] = []
        self.live: list[str] = []
        self.kept: list[str] = []
        self.nbytes = 0

    def dir(self, fd: int, where: Path, *, top: bool = False) -> bool:
        """Collect ``where``'s entries; ``False`` when something in it must stay."""
        whole = True
        for name in sorted(os.listdir(fd)):
            path = where / name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = open_subdir(fd, name, create=False, where=str(path))
                except (UnsafePathError, OSError) as exc:
                    self.kept.append(f"kept {path}: {exc}")
                    whole = False
                    continue
                try:
                    whole = self.dir(sub, path) and whole
                finally:
                    os.close(sub)
                continue
            self._live(fd, name, path, namespace=top or ns.is_topology_dir(where.name))
            self.files.append(str(path))
            self.nbytes += st.st_size
        if whole:
            self.dirs.append(str(where))
        return whole

    def _live(self, fd: int, name: str, path: Path, *, namespace: bool) -> None:
        if namespace and (name == "lock" or name.endswith(".lock")):
            try:
                held = lock_is_held(fd, name, where=str(path))
            except UnknownLock as exc:
                self.live.append(str(exc))
                return
            if held:
                self.live.append(f"a live process holds its lock {path}")
            else:
                self.locks.append((str(path.parent), name))
        temp = TempName.parse(name)
        if temp is None:
            return
        if temp.scope != self.scope or not self.scope.known:
            self.live.append(
                f"{path} is a temp file of another host, boot or PID namespace, whose writer "
                "cannot be judged from here"
            )
        elif temp.pid != os.getpid() and pid_alive(temp.pid):
            self.live.append(f"a live writer (pid {temp.pid}) is writing {path}")

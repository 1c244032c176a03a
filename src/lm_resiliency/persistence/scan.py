"""What a checkpoint folder holds: runs, topologies, generations, shards, sidecars.

Read-only and safe to run on a live folder: nothing is created, reaped or
followed through a symlink, and nothing is opened that could block (a FIFO in
place of a file is reported, not read). Each shard's header is validated
(schema, version, identity against the manifests and its own location, tensor
table, size, and the state document as recovery decodes it:
:func:`~lm_resiliency.persistence.document.check_state`); with ``verify=True`` its
data is read and every CRC checked as well. A manifest that names another run
or topology than its directory's is refused as the store refuses it. Every
entry is also judged like the library judges it before use
(:func:`lm_resiliency._safefs.judge`): an entry owned by another
user, writable by group or others, or of the wrong kind is an
:class:`EntryProblem` of the level that holds it. Run it as the job's user.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm_resiliency._safefs import entry_kind, judge, open_subdir, opened_dir
from lm_resiliency._tempnames import TempName, TempScope, is_stale
from lm_resiliency.errors import (
    IdentityMismatch,
    ShardUnavailable,
    SidecarUnavailable,
    UnsafePathError,
)
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.document import ShardIdentity, check_state
from lm_resiliency.persistence.format import read_data
from lm_resiliency.persistence.sidecar import read_status
from lm_resiliency.persistence.store import open_shard


@dataclass
class ShardInfo:
    """One shard file; ``problem`` is the unavailability reason (``None`` when usable)."""

    owner_rank: int
    size_bytes: int
    trust: str | None = None
    checksums: bool | None = None
    verified_crc: bool = False
    problem: str | None = None
    detail: str | None = None


@dataclass
class EntryProblem:
    """An entry the library would refuse to use: ``reason`` is an ``UnsafePathError`` reason."""

    path: str
    reason: str
    detail: str

    @classmethod
    def of(cls, exc: UnsafePathError) -> EntryProblem:
        return cls(exc.path, exc.reason, str(exc))


@dataclass
class GenerationInfo:
    step: int
    shards: list[ShardInfo] = field(default_factory=list)
    problems: list[EntryProblem] = field(default_factory=list)


@dataclass
class TopologyInfo:
    name: str
    topology: str | None
    generations: list[GenerationInfo] = field(default_factory=list)
    sidecars: dict[int, dict[str, Any]] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)
    problems: list[EntryProblem] = field(default_factory=list)


@dataclass
class RunInfo:
    name: str
    run_id: str | None
    topologies: list[TopologyInfo] = field(default_factory=list)
    problems: list[EntryProblem] = field(default_factory=list)


def scan_checkpoints(folder: str | Path, *, verify: bool = False) -> list[RunInfo]:
    """Describe every run under ``folder`` (sorted by name).

    Raises ``OSError`` when ``folder`` cannot be read and ``UnsafePathError``
    when it is itself unsafe (writable by group or others without the sticky bit).
    """
    root = Path(folder).resolve(strict=True)
    runs = []
    with opened_dir(root, (), create=False) as root_fd:
        names = sorted(os.listdir(root_fd))
        for name in names:
            if not ns.is_run_dir(name):
                continue
            run = RunInfo(name, None)
            runs.append(run)
            problem = _unsafe(root_fd, name, root / name)
            if problem is not None:
                run.problems.append(problem)
                continue
            try:
                _scan_run(root, run, verify)
            except UnsafePathError as exc:  # replaced while we looked
                run.problems.append(EntryProblem.of(exc))
            except FileNotFoundError:
                runs.remove(run)
    return runs


def _unsafe(dir_fd: int, name: str, where: Path) -> EntryProblem | None:
    """Why entry ``name`` would be refused (its kind decides what is expected), or ``None``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    problem = judge(st, str(where), expect="dir" if stat.S_ISDIR(st.st_mode) else "file")
    return None if problem is None else EntryProblem.of(problem)


def _manifest(dir_fd: int, name: str, where: Path, problems: list[EntryProblem]) -> str | None:
    """The identity a manifest names (``None`` when absent, unreadable, unsafe or foreign).

    A manifest that names an identity whose directory is not the one holding it
    (another run's ``run.json``) is a problem: the store refuses it
    (:func:`~lm_resiliency.persistence.namespace.check_manifest`).
    """
    try:
        doc = ns.read_manifest(dir_fd, name, where=str(where))
    except UnsafePathError as exc:
        problems.append(EntryProblem.of(exc))
        return None
    if doc is None:
        return None
    try:
        return ns.check_manifest(doc, name, dir_name=where.parent.name, where=str(where))
    except IdentityMismatch as exc:
        problems.append(EntryProblem(str(where), "identity", str(exc)))
        return None


def _scan_run(root: Path, run: RunInfo, verify: bool) -> None:
    where = root / run.name
    with opened_dir(root, (run.name,), create=False) as run_fd:
        run.run_id = _manifest(run_fd, ns.RUN_MANIFEST, where / ns.RUN_MANIFEST, run.problems)
        for topo in sorted(os.listdir(run_fd)):
            problem = _unsafe(run_fd, topo, where / topo)
            if problem is not None and topo != ns.RUN_MANIFEST:
                run.problems.append(problem)
            elif ns.is_topology_dir(topo):
                run.topologies.append(_scan_topology(root, run.name, topo, run.run_id, verify))


def _scan_topology(
    root: Path, run: str, topo: str, run_id: str | None, verify: bool
) -> TopologyInfo:
    where = root / run / topo
    with opened_dir(root, (run, topo), create=False) as topo_fd:
        info = TopologyInfo(topo, None)
        info.topology = _manifest(
            topo_fd, ns.TOPOLOGY_MANIFEST, where / ns.TOPOLOGY_MANIFEST, info.problems
        )
        for name in sorted(os.listdir(topo_fd)):
            kind = entry_kind(topo_fd, name)
            step = ns.parse_step_dir(name)
            rank = ns.parse_sidecar_file(name)
            if step is not None and kind == "dir":
                info.generations.append(
                    _scan_step(
                        topo_fd, where, step, run_id=run_id, topology=info.topology, verify=verify
                    )
                )
            elif rank is not None and run_id and info.topology:
                info.sidecars[rank] = _sidecar(topo_fd, where / name, run_id, info.topology, rank)
            elif name != ns.TOPOLOGY_MANIFEST:
                problem = _unsafe(topo_fd, name, where / name)
                if problem is not None:
                    info.problems.append(problem)
                if rank is None:
                    info.stray.append(_describe(name, kind))
    info.generations.sort(key=lambda g: g.step)
    return info


def _describe(name: str, kind: str | None) -> str:
    temp = TempName.parse(name)
    if temp is None:
        return f"{name} ({kind})"
    scope = TempScope.current()
    if temp.scope != scope:
        owner = "another boot or PID namespace: never reaped from here"
    elif is_stale(temp, scope):
        owner = f"writer pid {temp.pid} is dead: reaped by the next write"
    else:
        owner = f"writer pid {temp.pid} is alive"
    return f"{name} (temp file; {owner})"


def _sidecar(topo_fd: int, path: Path, run_id: str, topology: str, rank: int) -> dict[str, Any]:
    try:
        status = read_status(
            topo_fd, run_id=run_id, topology=topology, rank=rank, where=str(path), retry_s=0.5
        )
    except (SidecarUnavailable, UnsafePathError) as exc:
        return {"problem": exc.reason, "detail": str(exc)}
    if status is None:
        return {"problem": "missing"}
    doc = status.to_json()
    return {k: doc[k] for k in ("candidate_step", "verified_step", "verified_history", "persisted")}


def _scan_step(
    topo_fd: int,
    where: Path,
    step: int,
    *,
    run_id: str | None,
    topology: str | None,
    verify: bool,
) -> GenerationInfo:
    gen = GenerationInfo(step)
    dname = ns.step_dir(step)
    try:
        step_fd = open_subdir(topo_fd, dname, create=False, where=str(where / dname))
    except (FileNotFoundError, UnsafePathError) as exc:  # removed or replaced while we looked
        if isinstance(exc, UnsafePathError):
            gen.problems.append(EntryProblem.of(exc))
        return gen
    try:
        for name in sorted(os.listdir(step_fd)):
            owner = ns.parse_shard_file(name)
            path = where / dname / name
            if owner is None:
                problem = _unsafe(step_fd, name, path)
                if problem is not None:
                    gen.problems.append(problem)
                continue
            size = os.stat(name, dir_fd=step_fd, follow_symlinks=False).st_size
            shard = ShardInfo(owner_rank=owner, size_bytes=size)
            expected = None
            if run_id and topology:
                expected = ShardIdentity(run_id, topology, owner, step)
            _check(step_fd, owner, path, expected=expected, verify=verify, shard=shard)
            gen.shards.append(shard)
    finally:
        os.close(step_fd)
    gen.shards.sort(key=lambda s: s.owner_rank)
    return gen


def _check(
    step_fd: int,
    owner: int,
    path: Path,
    *,
    expected: ShardIdentity | None,
    verify: bool,
    shard: ShardInfo,
) -> None:
    try:
        fd, header = open_shard(step_fd, owner, path, expected, verify_integrity=False)
        try:
            shard.trust = header.doc.trust.value
            shard.checksums = header.doc.integrity is not None
            if verify:
                arena = read_data(fd, header, path)
                check_state(header.doc, path, arena=arena)
                shard.verified_crc = shard.checksums
            else:
                check_state(header.doc, path)
        finally:
            os.close(fd)
    except ShardUnavailable as exc:
        shard.problem, shard.detail = exc.reason, str(exc)


#: Sidecar problems that mean an unsafe entry (not merely stale or damaged content).
_UNSAFE_SIDECAR = {"symlink", "not_a_file", "foreign_owner", "writable_by_others"}


def problems(runs: list[RunInfo]) -> list[str]:
    """One line per unusable shard and per unsafe entry (empty: the folder is sound)."""
    out: list[str] = []
    for run in runs:
        out += [p.detail for p in run.problems]
        for topo in run.topologies:
            out += [p.detail for p in topo.problems]
            out += [
                str(side.get("detail"))
                for side in topo.sidecars.values()
                if side.get("problem") in _UNSAFE_SIDECAR
            ]
            for gen in topo.generations:
                out += [p.detail for p in gen.problems]
                out += [str(s.detail) for s in gen.shards if s.problem is not None]
    return out


def to_json(runs: list[RunInfo]) -> list[dict[str, Any]]:
    """Plain JSON-ready dicts of :func:`scan_checkpoints`'s result."""
    return [asdict(r) for r in runs]

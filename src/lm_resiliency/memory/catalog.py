"""What a memory folder holds: runs, topologies, ranks and their slot files.

Read-only and safe on a live folder: nothing is created, locked or followed
through a link, and each slot file is judged from its prefix and commit record
alone (its data is never mapped). A rank folder is *live* while a process
holds its lock. Used by ``lm-resiliency inspect --memory-folder`` and
``lm-resiliency clean``.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm_resiliency.memory.folder import is_locked
from lm_resiliency.memory.slotfile import MAGIC, SlotFileState
from lm_resiliency.persistence import namespace as ns

_PREFIX = struct.Struct("<8sIIQqQQQI")
_MAX_RECORD = 16 << 20


@dataclass
class SlotInfo:
    """One slot file: its role, step and state (``problem`` when it is not a usable slot)."""

    name: str
    size_bytes: int
    state: str = "?"
    step: int | None = None
    owner_rank: int | None = None
    run_id: str | None = None
    problem: str | None = None


@dataclass
class RankFolder:
    rank: int
    path: str
    live: bool
    slots: list[SlotInfo] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.slots)


@dataclass
class MemoryRun:
    name: str
    run_id: str | None
    ranks: list[RankFolder] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return any(r.live for r in self.ranks)


def scan_memory(folder: str | Path) -> list[MemoryRun]:
    """Every run under the memory folder ``folder`` (sorted by directory name)."""
    root = Path(folder)
    runs = []
    for run in sorted(root.iterdir()) if root.is_dir() else []:
        if not ns.is_run_dir(run.name) or run.is_symlink() or not run.is_dir():
            continue
        info = MemoryRun(run.name, None)
        for topo in sorted(run.iterdir()):
            if not ns.is_topology_dir(topo.name) or topo.is_symlink() or not topo.is_dir():
                continue
            for rank_dir in sorted(topo.iterdir()):
                if not rank_dir.name.startswith("rank-") or rank_dir.is_symlink():
                    continue
                rank = RankFolder(int(rank_dir.name[5:]), str(rank_dir), is_locked(rank_dir))
                for entry in sorted(rank_dir.iterdir()):
                    if entry.name.endswith(".slot"):
                        rank.slots.append(_slot(entry))
                info.run_id = info.run_id or next((s.run_id for s in rank.slots if s.run_id), None)
                info.ranks.append(rank)
        runs.append(info)
    return runs


def _slot(path: Path) -> SlotInfo:
    st = os.lstat(path)
    info = SlotInfo(path.name, st.st_size)
    if not stat.S_ISREG(st.st_mode):
        info.problem = "not a regular file"
        return info
    if st.st_uid != os.geteuid():
        info.problem = f"owned by uid {st.st_uid}"
        return info
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        info.problem = exc.strerror
        return info
    try:
        head = os.pread(fd, _PREFIX.size, 0)
        if len(head) < _PREFIX.size or head[:8] != MAGIC:
            info.problem = "not an lm-resiliency slot"
            return info
        _, _, state, _, step, _, rec_off, rec_bytes, _ = _PREFIX.unpack(head)
        info.state = SlotFileState(state).name if state in (0, 1, 2) else f"unknown {state}"
        if state == SlotFileState.COMMITTED:
            info.step = step
            if 0 < rec_bytes <= _MAX_RECORD:
                try:
                    record = json.loads(os.pread(fd, rec_bytes, rec_off))
                    info.owner_rank = record.get("owner_rank")
                    info.run_id = record.get("run_id")
                except ValueError:
                    info.problem = "damaged commit record"
    finally:
        os.close(fd)
    return info


def to_json(runs: list[MemoryRun]) -> list[dict[str, Any]]:
    return [{**asdict(r), "live": r.live} for r in runs]

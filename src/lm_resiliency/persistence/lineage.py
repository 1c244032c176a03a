"""Timelines: which generations of a run belong to the history the job is continuing.

A run id can outlive a timeline: a job that falls back to a durable
checkpoint at step 40 (or starts afresh) under the same ``--rdzv-id`` leaves
the generations of its predecessor (say, up to step 100) on disk and in
memory. Ranking generations by step number would keep resuming, and keep
retaining, the abandoned history. So every manager starts a new *timeline*
and records, once it knows, where it came from: the timeline and step it
recovered (``parent``, ``fork_step``), or nothing (a fresh start or a durable
fallback: a root). Every generation records the timeline that wrote it.

The *lineage* is the list of timelines, oldest first; its last entry is the
head. A generation is **eligible** for recovery, and kept by retention, only
when it lies on the head's ancestry: written by the head, or by an ancestor
at or before the step where its child forked. A timeline that is not in the
lineage at all (another job's) is never selected and never deleted.

A run that finished (``close()`` after the last step) marks its head
``finished_step``; a later launch with the same run id and folder does not
resume it unless asked (``resume="finished"``).

Each rank keeps a copy of the lineage in its memory folder and its disk
topology folder (``lineage-rank-<R>.json``); at construction the ranks agree
on the longest one, so a replaced node learns it from the others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lm_resiliency._safefs import open_file_nofollow, pread_exact
from lm_resiliency.persistence.publish import publish_bytes

LINEAGE_KIND = "lm_resiliency.lineage"
LINEAGE_VERSION = 1
#: Timelines kept (older ones can no longer hold eligible generations worth keeping).
MAX_TIMELINES = 64
_MAX_BYTES = 1 << 20


def lineage_file(rank: int) -> str:
    return f"lineage-rank-{rank}.json"


@dataclass(frozen=True)
class Timeline:
    id: str
    parent: str | None = None
    fork_step: int | None = None
    finished_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent": self.parent,
            "fork_step": self.fork_step,
            "finished_step": self.finished_step,
        }


def _step(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


@dataclass(frozen=True)
class Lineage:
    """The run's timelines, oldest first (immutable; ``with_*`` return new lineages)."""

    timelines: tuple[Timeline, ...] = field(default_factory=tuple)

    @property
    def head(self) -> Timeline | None:
        return self.timelines[-1] if self.timelines else None

    def knows(self, timeline: str | None) -> bool:
        return any(t.id == timeline for t in self.timelines)

    def eligible(self, step: int, timeline: str | None) -> bool:
        """Whether a generation of ``timeline`` at ``step`` lies on the head's history.

        Without any recorded timeline everything is eligible (a run that
        predates timelines); a generation without a timeline is eligible only
        then.
        """
        if not self.timelines:
            return True
        by_id = {t.id: t for t in self.timelines}
        node = self.head
        limit: int | None = None
        while node is not None:
            if node.id == timeline:
                return limit is None or step <= limit
            if node.parent is None or node.fork_step is None:
                return False
            limit = node.fork_step if limit is None else min(limit, node.fork_step)
            node = by_id.get(node.parent)
        return False

    def superseded(self, step: int, timeline: str | None) -> bool:
        """A generation of a timeline this lineage knows that is not on the head's history."""
        return self.knows(timeline) and not self.eligible(step, timeline)

    def with_timeline(self, entry: Timeline) -> Lineage:
        kept = tuple(t for t in self.timelines if t.id != entry.id)
        return Lineage((*kept, entry)[-MAX_TIMELINES:])

    def with_finished(self, step: int | None) -> Lineage:
        head = self.head
        if head is None:
            return self
        return Lineage((*self.timelines[:-1], replace(head, finished_step=step)))

    def to_json(self, run_id: str, rank: int) -> dict[str, Any]:
        return {
            "kind": LINEAGE_KIND,
            "version": LINEAGE_VERSION,
            "run_id": run_id,
            "rank": rank,
            "timelines": [t.to_json() for t in self.timelines],
        }

    @classmethod
    def from_json(cls, doc: Any, *, run_id: str) -> Lineage:
        """Parse a lineage document; raise ``ValueError`` for anything malformed or foreign."""
        if not isinstance(doc, dict) or doc.get("kind") != LINEAGE_KIND:
            raise ValueError("not a lineage document")
        if doc.get("version") != LINEAGE_VERSION or doc.get("run_id") != run_id:
            raise ValueError(f"lineage of version {doc.get('version')!r} / another run")
        rows = doc.get("timelines")
        if not isinstance(rows, list) or len(rows) > MAX_TIMELINES:
            raise ValueError("timelines is not a bounded list")
        out = []
        for row in rows:
            if not (
                isinstance(row, dict)
                and set(row) == {"id", "parent", "fork_step", "finished_step"}
                and isinstance(row["id"], str)
                and (row["parent"] is None or isinstance(row["parent"], str))
                and _step(row["fork_step"])
                and _step(row["finished_step"])
            ):
                raise ValueError(f"malformed timeline entry {row!r:.200}")
            out.append(Timeline(row["id"], row["parent"], row["fork_step"], row["finished_step"]))
        return cls(tuple(out))

    def encode(self) -> bytes:
        return json.dumps([t.to_json() for t in self.timelines], separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes, *, run_id: str) -> Lineage:
        rows = json.loads(blob.decode()) if blob else []
        return cls.from_json(
            {"kind": LINEAGE_KIND, "version": LINEAGE_VERSION, "run_id": run_id, "timelines": rows},
            run_id=run_id,
        )


def merge(lineages: Sequence[Lineage]) -> tuple[Lineage, bool]:
    """The longest lineage, and whether every other one is a prefix of it (consistent)."""
    best = max(lineages, key=lambda lin: len(lin.timelines), default=Lineage())
    ids = [t.id for t in best.timelines]
    consistent = all([t.id for t in lin.timelines] == ids[: len(lin.timelines)] for lin in lineages)
    return best, consistent


def read_lineage(dir_fd: int, name: str, *, run_id: str, where: str) -> Lineage | None:
    """A lineage file in ``dir_fd`` (``None`` if absent or unusable; never follows a link)."""
    try:
        fd = open_file_nofollow(dir_fd, name, os.O_RDONLY | os.O_NONBLOCK, where=where)
    except (FileNotFoundError, OSError):
        return None
    except Exception:  # a link or not a regular file: not ours to read
        return None
    try:
        raw = pread_exact(fd, _MAX_BYTES, 0)
    finally:
        os.close(fd)
    try:
        return Lineage.from_json(json.loads(raw.decode("utf-8")), run_id=run_id)
    except (UnicodeDecodeError, ValueError):
        return None


def write_lineage(dir_fd: int, name: str, lineage: Lineage, *, run_id: str, rank: int) -> None:
    """Atomically replace the lineage file ``name`` in ``dir_fd``."""
    body = json.dumps(lineage.to_json(run_id, rank), indent=1).encode() + b"\n"
    publish_bytes(dir_fd, name, body)

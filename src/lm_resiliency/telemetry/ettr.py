"""ETTR: effective time to recovery, from fault detection to ready-to-resume, per event.

Times come from ``time.perf_counter_ns`` (monotonic, nanoseconds). An event is
recorded on the rank that recovered; export one row per event as CSV or JSONL.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class RecoveryEvent:
    """One recovery: ``kind`` is ``"abort"`` (before the update) or ``"rollback"`` (shadow)."""

    kind: str
    step: int
    attempt: int
    rank: int
    detected_ns: int
    ready_ns: int
    reasons: str = ""
    restored_bytes: int = 0

    @property
    def duration_ns(self) -> int:
        """Nanoseconds from detection to ready-to-resume."""
        return self.ready_ns - self.detected_ns


_FIELDS = [f.name for f in fields(RecoveryEvent)]


class EttrTimer:
    """Collects :class:`RecoveryEvent` records of one rank.

    Call :meth:`now` when a fault is detected and :meth:`record` once the
    training can resume; the elapsed time between the two is the ETTR.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.events: list[RecoveryEvent] = []

    @staticmethod
    def now() -> int:
        """The clock used for every event (``time.perf_counter_ns``)."""
        return time.perf_counter_ns()

    def record(
        self,
        kind: str,
        *,
        step: int,
        attempt: int,
        detected_ns: int,
        reasons: str = "",
        restored_bytes: int = 0,
    ) -> RecoveryEvent:
        """Close an event that started at ``detected_ns``; ready time is now."""
        event = RecoveryEvent(
            kind=kind,
            step=step,
            attempt=attempt,
            rank=self.rank,
            detected_ns=detected_ns,
            ready_ns=self.now(),
            reasons=reasons,
            restored_bytes=restored_bytes,
        )
        self.events.append(event)
        return event

    def durations_ns(self, kind: str | None = None) -> list[int]:
        """ETTR of every event (of one ``kind`` if given), in recording order."""
        return [e.duration_ns for e in self.events if kind is None or e.kind == kind]

    def median_ns(self, kind: str | None = None) -> float | None:
        """Median ETTR in nanoseconds, or ``None`` without events."""
        d = self.durations_ns(kind)
        return statistics.median(d) if d else None

    def to_csv(self, path: str | Path) -> Path:
        """Write one header row and one row per event (``duration_ns`` added); returns the path."""
        return write_csv(self.events, path)

    def to_jsonl(self, path: str | Path) -> Path:
        """Write one JSON object per event (``duration_ns`` added); returns the path."""
        return write_jsonl(self.events, path)


def write_csv(events: Iterable[RecoveryEvent], path: str | Path) -> Path:
    """Export ``events`` as CSV with the columns of :class:`RecoveryEvent` plus ``duration_ns``."""
    out = Path(path)
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*_FIELDS, "duration_ns"])
        writer.writeheader()
        for e in events:
            writer.writerow({**asdict(e), "duration_ns": e.duration_ns})
    return out


def write_jsonl(events: Iterable[RecoveryEvent], path: str | Path) -> Path:
    """Export ``events`` as JSON lines (one object per event)."""
    out = Path(path)
    with out.open("w") as fh:
        for e in events:
            fh.write(json.dumps({**asdict(e), "duration_ns": e.duration_ns}) + "\n")
    return out


def read_csv(path: str | Path) -> list[RecoveryEvent]:
    """Events written by :func:`write_csv`."""
    with Path(path).open(newline="") as fh:
        return [_from_row(row) for row in csv.DictReader(fh)]


def read_jsonl(path: str | Path) -> list[RecoveryEvent]:
    """Events written by :func:`write_jsonl`."""
    lines = Path(path).read_text().splitlines()
    return [_from_row(json.loads(line)) for line in lines if line.strip()]


def _from_row(row: dict[str, object]) -> RecoveryEvent:
    ints = {"step", "attempt", "rank", "detected_ns", "ready_ns", "restored_bytes"}
    return RecoveryEvent(
        **{k: (int(str(row[k])) if k in ints else str(row[k])) for k in _FIELDS}  # type: ignore[arg-type]
    )

"""Structured JSONL event log: one JSON object per line, one ``write`` per line.

One class, two record shapes, for its two kinds of reader:

* :meth:`EventLog.log` (MTGS, SCOUT, the fault injector, ``lm-resiliency train``): every
  record has ``ts_ns`` (wall clock, ``time.time_ns``), ``rank`` and ``event`` plus the
  caller's fields (JSON-encodable values only, no NaN). Read back with :func:`read_events`.
* :meth:`EventLog.emit` (the demo's workers, :mod:`lm_resiliency.demo.events`): ``event``,
  ``t`` (wall-clock seconds), ``rank``, ``attempt`` and ``pid`` plus the caller's fields,
  keys sorted, so records of several processes on one machine can be compared.

Each line goes to the file in one ``os.write`` on a descriptor opened for appending, so a
process killed mid-run leaves only complete lines (a reader skips a cut last line) and
a signal handler may call either method: the log holds no lock and opens nothing after
construction. ``path=None`` keeps records in memory only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events"]


class EventLog:
    """Append-only JSONL log of one process; every record written is also kept in ``records``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        rank: int = 0,
        attempt: int | None = None,
    ) -> None:
        self.rank = rank
        self.attempt = attempt
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record ``event`` with ``fields`` (``ts_ns``, ``rank``, ``event``); returns the record.

        Raises ``TypeError`` for values JSON cannot encode (``ValueError`` for NaN).
        """
        record = {"ts_ns": time.time_ns(), "rank": self.rank, "event": event, **fields}
        self._write(record, json.dumps(record, allow_nan=False))
        return record

    def emit(self, event: str, *, t: float | None = None, **fields: Any) -> None:
        """Record ``event`` with ``t`` (default: now), ``rank``, ``attempt`` and ``pid``.

        ``fields`` must be JSON-ready.
        """
        record = {
            "event": event,
            "t": time.time() if t is None else t,
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            **fields,
        }
        self._write(record, json.dumps(record, sort_keys=True))

    def _write(self, record: dict[str, Any], line: str) -> None:
        self.records.append(record)
        if self._fd is not None:
            os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        """Close the file (further records are only kept in memory). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All records of one JSONL event log file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

"""Structured JSONL event log: one JSON object per line, flushed line by line.

Every record has ``ts_ns`` (wall clock, ``time.time_ns``), ``rank`` and
``event`` plus the caller's fields (JSON-encodable values only). Lines are
flushed as written, so a process killed mid-run leaves only complete lines.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any


class EventLog:
    """Append-only JSONL log of one rank; ``path=None`` keeps records in memory only."""

    def __init__(self, path: str | Path | None = None, *, rank: int = 0) -> None:
        self.rank = rank
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        self._fh: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", buffering=1)

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record ``event`` with ``fields``; raises ``TypeError`` for values JSON cannot encode."""
        record = {"ts_ns": time.time_ns(), "rank": self.rank, "event": event, **fields}
        line = json.dumps(record, allow_nan=False)
        self.records.append(record)
        if self._fh is not None:
            self._fh.write(line + "\n")
        return record

    def close(self) -> None:
        """Close the file (further ``log`` calls only keep records in memory)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL event log."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

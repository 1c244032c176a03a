"""JSON-lines records that demo workers leave in the run folder for the parent to read.

Each worker process appends to its own file
``<run_dir>/events/rank-<R>-attempt-<A>-pid-<P>.jsonl``, one JSON object per
line: ``{"event": ..., "t": <wall-clock seconds>, "rank": R, "attempt": A,
"pid": P, ...}``. One writer per file and one ``write`` per line, so a reader
never sees two records interleaved; a line cut short by a kill is skipped. Wall
clock (``time.time``) is used because the records of different processes, on
the same machine, are compared with each other.

The writer is safe to call from a signal handler: it holds no lock and opens
nothing after construction.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_DIR", "EventLog", "process_start_time", "read_events"]

EVENTS_DIR = "events"


class EventLog:
    """This process's record file in ``run_dir`` (created on construction)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int, attempt: int | None) -> None:
        self.rank = rank
        self.attempt = attempt
        folder = Path(run_dir) / EVENTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}-attempt-{attempt}-pid-{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, *, t: float | None = None, **fields: Any) -> None:
        """Append one record; ``t`` defaults to now. ``fields`` must be JSON-ready."""
        record = {
            "event": event,
            "t": time.time() if t is None else t,
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            **fields,
        }
        os.write(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete record in ``run_dir``, ordered by time (empty if none yet).

    Safe while workers are still writing: a trailing partial line is ignored.
    """
    folder = Path(run_dir) / EVENTS_DIR
    records: list[dict[str, Any]] = []
    if not folder.is_dir():
        return records
    for path in sorted(folder.glob("*.jsonl")):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        for line in text.split("\n")[:-1]:  # the piece after the last newline is unfinished
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a record cut by a SIGKILL
            if isinstance(record, dict) and "event" in record and "t" in record:
                records.append(record)
    records.sort(key=lambda r: float(r["t"]))
    return records


def process_start_time() -> float:
    """Wall-clock time at which this process was started (Linux; ~10 ms resolution).

    Read from ``/proc`` rather than taken at import, so the interpreter's start
    and the imports count as part of a restart.
    """
    with open("/proc/self/stat") as f:
        # The command name is parenthesized and may contain spaces; field 22
        # (start time in clock ticks after boot) is the 20th after it.
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))

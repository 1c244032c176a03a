"""JSON-lines records that demo workers leave in the run folder for the parent to read.

Each worker process appends to its own file
``<run_dir>/events/rank-<R>-attempt-<A>-pid-<P>.jsonl``, one JSON object per
line: ``{"event": ..., "t": <wall-clock seconds>, "rank": R, "attempt": A,
"pid": P, ...}``. One writer per file and one ``write`` per line, so a reader
never sees two records interleaved; a line cut short by a kill is skipped. Wall
clock (``time.time``) is used because the records of different processes, on
the same machine, are compared with each other.

The writer is :class:`lm_resiliency.telemetry.EventLog` (its ``emit`` records), safe
to call from a signal handler: it holds no lock and opens nothing after construction.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lm_resiliency.telemetry.events import EventLog

__all__ = ["EVENTS_DIR", "process_start_time", "read_run_events", "run_event_log"]

EVENTS_DIR = "events"


def run_event_log(run_dir: str | os.PathLike[str], *, rank: int, attempt: int | None) -> EventLog:
    """This process's record file in ``run_dir`` (created now); write with ``emit``."""
    path = Path(run_dir) / EVENTS_DIR / f"rank-{rank}-attempt-{attempt}-pid-{os.getpid()}.jsonl"
    return EventLog(path, rank=rank, attempt=attempt)


def read_run_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
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

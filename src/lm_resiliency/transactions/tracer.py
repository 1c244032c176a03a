"""Trace events of the MTGS phases, as Chrome trace JSON or torch profiler ranges.

One event per phase of every attempt: ``shadow`` (the shadow copy, from its launch
at the step's start to the end of the wait before ``optimizer.step()``), ``sync``
(forward and backward passes, where the gradient all-reduce and the vote travel),
``vote`` (reading the reduced vote), ``commit`` (the update and its confirmation),
``abort`` (discarding a vote-phase abort) and ``rollback`` (restoring the shadow
after a failed update, or a local repair without 2PC). Each carries the rank, the
step, the attempt and nanosecond times (``start_ns``: wall clock, so the ranks'
files line up; ``duration_ns``: monotonic).

Use (every rank, its own file)::

    tracer = Tracer(f"trace-rank{rank}.json", rank=rank)
    txn = MTGS(ddp, optimizer, tracer=tracer)
    ...
    tracer.close()  # writes the file; merge_traces() joins the ranks' files

The file is the Chrome trace event format (``{"traceEvents": [...]}``, complete
``"X"`` events, microsecond ``ts``/``dur``, ``pid`` = rank), which Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open. While a ``torch.profiler`` is
recording, each phase is also a ``record_function`` range named ``mtgs.<phase>``,
so it shows in the profiler's own trace beside the collectives.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["PHASES", "Span", "Tracer", "merge_traces"]

PHASES = ("shadow", "sync", "vote", "commit", "abort", "rollback")
_THREADS = {"shadow": 1}  # the shadow copy overlaps the training thread's phases


@dataclass
class Span:
    """An open phase: returned by :meth:`Tracer.start`, closed by :meth:`Tracer.end`."""

    phase: str
    wall_ns: int
    mono_ns: int
    profiler_range: Any = None


class Tracer:
    """Collects this rank's phase events; :meth:`close` writes them (Chrome trace JSON).

    ``path=None`` keeps the events in memory only (``events``), e.g. to forward
    them to the profiler alone. Not thread-safe: MTGS calls it from the
    training thread only.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, rank: int) -> None:
        self.path = Path(path) if path is not None else None
        self.rank = rank
        self.events: list[dict[str, Any]] = []

    def start(self, phase: str) -> Span:
        """Open ``phase`` (one of :data:`PHASES`); a profiler range opens with it if one runs."""
        if phase not in PHASES:
            raise ValueError(f"unknown MTGS trace phase {phase!r}; use one of {list(PHASES)}")
        rf = None
        if torch.autograd._profiler_enabled():
            rf = torch.profiler.record_function(f"mtgs.{phase}")
            rf.__enter__()
        return Span(phase, time.time_ns(), time.perf_counter_ns(), rf)

    def end(self, span: Span, *, step: int, attempt: int, **args: Any) -> None:
        """Close ``span`` and record its event (``args``: extra JSON-able fields)."""
        duration = time.perf_counter_ns() - span.mono_ns
        if span.profiler_range is not None:
            span.profiler_range.__exit__(None, None, None)
        self.events.append(
            {
                "name": span.phase,
                "cat": "mtgs",
                "ph": "X",
                "ts": span.wall_ns / 1e3,
                "dur": duration / 1e3,
                "pid": self.rank,
                "tid": _THREADS.get(span.phase, 0),
                "args": {
                    "rank": self.rank,
                    "step": step,
                    "attempt": attempt,
                    "start_ns": span.wall_ns,
                    "duration_ns": duration,
                    **args,
                },
            }
        )

    def document(self) -> dict[str, Any]:
        """The Chrome trace document of the events so far (with thread names)."""
        names = [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": n}}
            for tid, n in ((0, "training"), (1, "shadow copy"))
        ]
        process = {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"name": f"rank {self.rank}"}}  # fmt: skip
        return {"traceEvents": [process, *names, *self.events], "displayTimeUnit": "ns"}

    def close(self) -> None:
        """Write the trace file (atomically: a temp file, then a rename); idempotent."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.document()))
        tmp.replace(self.path)


def merge_traces(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Join per-rank trace files into one (each rank is a process in Perfetto)."""
    events: list[dict[str, Any]] = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise ValueError(f"{p} is not a Chrome trace document (no traceEvents list)")
        events.extend(doc["traceEvents"])
    target = Path(out)
    target.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    return target

"""The manager's recovery: gather availability, choose the step, fetch it, say what happened.

Call order (every rank; both calls are collective)::

    steps = restorer.candidates(mode)      # find_latest(): newest common step first
    outcome = restorer.load(step, mode)    # load(): fetch, walk back, or fall back

Both run over the control plane, so every wait is bounded and a rank that does
not answer is named. Logging: one WARNING line on rank 0 when a restarted job
(or one whose run left files or slots) recovers nothing, naming why and each
rank's newest available step. Every recovery (a GEMINI step, or the
``load_fallback`` when none is common) prints one line on rank 0 to stderr,
seen without any logging setup: the step, each rank's source and the seconds.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lm_resiliency.control import ControlPlane
from lm_resiliency.errors import NoConsistentStep
from lm_resiliency.recovery.availability import (
    Options,
    Report,
    Source,
    common_steps,
    gather_reports,
    missing_lines,
    source_options,
)
from lm_resiliency.recovery.fetch import FetchContext, Fetched, Unusable, fetch_step
from lm_resiliency.recovery.mode import RecoveryMode

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    """What one ``load`` did: the step, each rank's source, bytes moved, time per phase."""

    step: int | None
    sources: list[str]
    bytes_moved: int
    walked_back_from: list[int] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """Every source that failed validation on the way, with its rank and reason."""
    not_own_memory: list[str] = field(default_factory=list)
    """For every rank not served from own memory: why (its own slot of the step failed a
    check, with the reason, or own memory holds no such step, with the steps it holds)."""


@dataclass
class Outcome:
    state: Any
    report: RecoveryReport
    fetched: Fetched | None


class Restorer:
    """Recovery of one rank; see the module docstring."""

    def __init__(
        self,
        *,
        control: ControlPlane,
        report: Callable[[], Report],
        context: Callable[[], FetchContext],
        holder_of: Callable[[int], int | None],
        restarted: bool,
        other_topologies: list[str] | None = None,
    ) -> None:
        self._control = control
        self._report = report
        self._context = context
        self._holder_of = holder_of
        self._restarted = restarted
        self._other_topologies = list(other_topologies or [])
        self._said_nothing = False

    def gather(self, mode: RecoveryMode) -> tuple[Options, list[Report], set[int]]:
        reports = gather_reports(self._report(), control=self._control)
        table = source_options(reports, self._holder_of)
        verified = mode is RecoveryMode.RECOVERY_VERIFIED
        return table, reports, common_steps(table, reports, verified_only=verified)

    def newest(self, mode: RecoveryMode) -> int | None:
        """find_latest(): the newest step every rank can obtain, or ``None`` (said once)."""
        _, reports, common = self.gather(mode)
        if not common:
            self._say_nothing(reports, mode, "no step is available on every rank")
        return max(common) if common else None

    def load(
        self,
        step: int | None,
        mode: RecoveryMode,
        fallback: Callable[[], Any] | None,
    ) -> Outcome:
        t0 = time.perf_counter()
        table, reports, common = self.gather(mode)
        t_agree = time.perf_counter() - t0
        if step is not None and step not in common:
            raise NoConsistentStep(
                f"step {step} is not available on every rank in mode {mode.value}; common "
                f"steps: {sorted(common)}. " + "; ".join(missing_lines(step, table, reports))
            )
        candidates = sorted((s for s in common if step is None or s <= step), reverse=True)
        ctx = self._context()
        failed: list[int] = []
        problems: list[str] = []
        for s in candidates:
            t1 = time.perf_counter()
            got = fetch_step(s, table, ctx)
            if isinstance(got, Unusable):
                failed.append(s)
                problems += got.problems
                if self._control.rank == 0:
                    log.warning(
                        "step %d is unusable (%s); walking back%s",
                        s,
                        "; ".join(got.problems) or "a source failed",
                        " to an older verified step"
                        if mode is RecoveryMode.RECOVERY_VERIFIED
                        else "",
                    )
                continue
            phases = {"agree": t_agree, "fetch": time.perf_counter() - t1, **got.phases_s}
            labels = [src.label for src in got.sources]
            reasons = not_own_memory(s, got.sources, got.problems, reports)
            report = RecoveryReport(
                s, labels, got.bytes_moved, failed, phases, problems + got.problems, reasons
            )
            self._record(report, time.perf_counter() - t0)
            return Outcome(got.state, report, got)
        if failed and mode is RecoveryMode.RECOVERY_VERIFIED:
            raise NoConsistentStep(
                f"every verified step failed validation (tried {failed}): {'; '.join(problems)}; "
                "failing closed (RECOVERY_VERIFIED never falls back to unverified state)"
            )
        why = (
            f"every common step failed validation (tried {failed})"
            if failed
            else "no step is available on every rank"
        )
        self._say_nothing(reports, mode, why)
        if fallback is not None:
            report = RecoveryReport(
                None, [Source.FALLBACK.label] * len(table), 0, failed, {}, problems
            )
            state = fallback()
            self._record(report, time.perf_counter() - t0)
            return Outcome(state, report, None)
        lines = "; ".join(problems) or "; ".join(
            f"rank {r}: {rep.describe()}" for r, rep in enumerate(reports)
        )
        raise NoConsistentStep(
            f"rank {self._control.rank}: no {mode.value} GEMINI step is available on every rank "
            f"({why}: {lines}) and no load_fallback was given; pass "
            "load_fallback=<load your durable checkpoint> to recover from it"
        )

    def _record(self, report: RecoveryReport, seconds: float) -> None:
        log.info("gemini.recovery %s", json.dumps({"rank": self._control.rank, **asdict(report)}))
        if self._control.rank != 0:
            return
        by_source: dict[str, list[int]] = {}
        for rank, label in enumerate(report.sources):
            by_source.setdefault(label, []).append(rank)
        where = "; ".join(f"{label} on ranks {ranks}" for label, ranks in by_source.items())
        if report.step is not None:
            line = f"GEMINI recovered step {report.step} ({where}) in {seconds:.3f} s"
            if report.not_own_memory:
                line += "; not from own memory: " + "; ".join(report.not_own_memory)
        else:
            line = (
                f"GEMINI recovered no step; load_fallback() was used ({where}) in {seconds:.3f} s"
            )
        log.info("%s", line)
        # Seen without any logging setup: one line on rank 0 per recovery.
        print(f"lm-resiliency: {line}", file=sys.stderr, flush=True)

    def _say_nothing(self, reports: list[Report], mode: RecoveryMode, why: str) -> None:
        if self._said_nothing or self._control.rank != 0:
            return
        anything = any(any(r.to_json()[:4]) for r in reports)
        if not (self._restarted or anything or self._other_topologies):
            return  # a fresh job: nothing to recover is the expected answer
        self._said_nothing = True
        newest = ", ".join(
            f"rank {r}: {max(rep.own_memory | rep.own_disk, default='none')}"
            for r, rep in enumerate(reports)
        )
        other = (
            f"; this run has GEMINI checkpoints for another topology ({len(self._other_topologies)}"
            " namespace(s): another world size, pairing or replica layout): they cannot be "
            "loaded onto this one (resharding is not supported; restore a durable checkpoint "
            "with load_fallback, or restart with the original world size)"
            if self._other_topologies
            else ""
        )
        log.warning(
            "GEMINI recovers nothing (%s mode): %s; newest own step per rank: %s%s",
            mode.value,
            why,
            newest,
            other,
        )


def not_own_memory(
    step: int, sources: Sequence[Source], problems: Sequence[str], reports: Sequence[Report]
) -> list[str]:
    """For every rank whose final source of ``step`` is not its own memory: why not.

    Either its own slot of ``step`` failed a check while loading (the reason from
    ``problems``) or its own memory offered no such step (the steps it offered: a slot
    refused at re-attach, of another timeline, or handed over by an earlier recovery
    of this run is not offered).
    """
    lines = []
    for rank, source in enumerate(sources):
        if source is Source.OWN_MEMORY:
            continue
        prefix = f"rank {rank} {Source.OWN_MEMORY.label}: "
        failed = [p.removeprefix(prefix) for p in problems if p.startswith(prefix)]
        if failed:
            lines.append(f"rank {rank}: its own slot of step {step} failed: {failed[-1]}")
        else:
            held = sorted(reports[rank].own_memory)
            lines.append(f"rank {rank}: own memory has no step {step} (it holds {held or 'none'})")
    return lines

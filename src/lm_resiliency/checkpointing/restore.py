"""The manager's restore: gather availability, choose the step, fetch it, say what happened.

Vocabulary: the manager *restores* (``Restorer``, :class:`RestoreReport`,
``manager.last_restore``, ``commit_restore``); the step choice and fetch it drives are
:mod:`lm_resiliency.recovery`; the front door *resumes* (:mod:`lm_resiliency.frontdoor.resume`).

Call order (every rank; both calls are collective)::

    steps = restorer.candidates(mode)      # find_latest(): newest common step first
    outcome = restorer.load(step, mode)    # load(): fetch, walk back, or fall back

Both run over the control plane, so every wait is bounded and a rank that does
not answer is named. What this rank can offer comes from one :class:`SourceSet`,
built once by the manager from its parts (capture engine, peer replicas, the
node-local disk, the timeline history, the trust ledger): the restorer never
calls back into the manager. Logging: one WARNING line on rank 0 when a restarted job
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

from lm_resiliency.capture.target import Target
from lm_resiliency.checkpointing.history import History
from lm_resiliency.checkpointing.setup import Parts
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
from lm_resiliency.recovery.sources import DiskShards, MemorySlots, NoSource, StepSource
from lm_resiliency.replication import PairingPlan

log = logging.getLogger(__name__)


@dataclass
class RestoreReport:
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
    in_place: bool = False
    """This rank's state was restored into the tensors passed as ``load(into=...)``."""


@dataclass
class Outcome:
    state: Any
    report: RestoreReport
    fetched: Fetched | None


class SourceSet:
    """Where one rank can obtain a step, built once from the manager's parts.

    Own memory (the capture engine's slots, handed over after a load), own disk,
    and what this rank serves the rank it pairs with: that rank's replica in
    peer memory (or, HSDP, this rank's own identical slot) and on this disk.
    """

    def __init__(
        self,
        parts: Parts,
        *,
        control: ControlPlane,
        run_id: str,
        plan: PairingPlan | None,
        hsdp: bool,
        history: History,
    ) -> None:
        self.control = control
        self.rank = control.rank
        self._run_id = run_id
        self._plan = plan
        self._channel = parts.channel
        self._engine = engine = parts.engine
        self._peer = peer = parts.peer
        self._flusher = parts.flusher
        self._disk = disk = parts.disk
        self._history = history
        self._trust = parts.trust
        eligible = history.eligible

        def current(step: int, timeline: str | None) -> bool:
            return timeline is None or eligible(step, timeline)

        existing = disk.existing
        self.sources: dict[Source, StepSource] = {
            Source.OWN_MEMORY: MemorySlots(
                Source.OWN_MEMORY, engine.complete_slots, eligible=current, consumes=True
            ),
            Source.OWN_DISK: DiskShards(
                Source.OWN_DISK, existing, self.rank, eligible=eligible, streamed=False
            ),
            Source.PEER_MEMORY: NoSource(Source.PEER_MEMORY),
            Source.PEER_DISK: NoSource(Source.PEER_DISK),
        }
        owner = plan.recv_from(self.rank) if plan is not None and plan.has_peer else None
        if owner is not None:
            if peer is not None:
                self.sources[Source.PEER_MEMORY] = MemorySlots(
                    Source.PEER_MEMORY, peer.complete_slots, eligible=current, consumes=False
                )
            elif hsdp:  # a replica's own slot holds the identical shard
                self.sources[Source.PEER_MEMORY] = MemorySlots(
                    Source.PEER_MEMORY, engine.complete_slots, eligible=current, consumes=False
                )
            disk_owner = self.rank if hsdp else owner
            self.sources[Source.PEER_DISK] = DiskShards(
                Source.PEER_DISK, existing, disk_owner, eligible=eligible, streamed=True
            )

    def report(self) -> Report:
        """This rank's availability, once the in-flight capture and writes are done."""
        self._engine.wait_idle()
        self._flusher.wait_idle()
        src = self.sources
        verified = set(self._trust.verified())
        store = self._disk.existing()
        if store is not None:
            status = store.sidecar.status()
            verified |= set(status.verified_history)
            if status.verified_step is not None:
                verified.add(status.verified_step)
        return Report(
            src[Source.OWN_MEMORY].steps(),
            src[Source.OWN_DISK].steps(),
            src[Source.PEER_MEMORY].steps(),
            src[Source.PEER_DISK].steps(),
            frozenset(verified),
        )

    def holder_of(self, rank: int) -> int | None:
        """The rank holding ``rank``'s replica (``None`` without a peer)."""
        if self._plan is None or not self._plan.has_peer:
            return None
        return self._plan.send_to(rank)

    def timeline_of(self, step: int) -> str | None:
        """Collective: the timeline of the recovered ``step`` (rank 0's view of its generation)."""
        mine = None
        held = self._peer.slots if self._peer is not None else []
        for slot in self._engine.slots + held:
            if slot.step == step and slot.timeline is not None:
                mine = slot.timeline
        store = self._disk.existing()
        if mine is None and store is not None:
            mine = store.timeline_of(self.rank, step)
        if mine is None:
            head = self._history.lineage.head
            mine = head.id if head else ""
        gathered = self.control.all_gather_bytes(mine.encode(), name="agree the recovered timeline")
        chosen = next((g.decode() for g in gathered if g), "")
        return chosen or None

    def context(self) -> FetchContext:
        return FetchContext(
            rank=self.rank,
            world_size=self.control.world_size,
            control=self.control,
            run_id=self._run_id,
            plan=self._plan,
            channel=self._channel,
            sources=self.sources,
        )


class Restorer:
    """Recovery of one rank; see the module docstring."""

    def __init__(
        self,
        sources: SourceSet,
        *,
        restarted: bool,
        other_topologies: list[str] | None = None,
    ) -> None:
        self._sources = sources
        self._control = sources.control
        self._restarted = restarted
        self._other_topologies = list(other_topologies or [])
        self._said_nothing = False

    def gather(self, mode: RecoveryMode) -> tuple[Options, list[Report], set[int]]:
        reports = gather_reports(self._sources.report(), control=self._control)
        table = source_options(reports, self._sources.holder_of)
        verified = mode is RecoveryMode.RECOVERY_VERIFIED
        return table, reports, common_steps(table, reports, verified_only=verified)

    def timeline_of(self, step: int) -> str | None:
        """Collective: the timeline the recovered ``step`` continues (see :class:`SourceSet`)."""
        return self._sources.timeline_of(step)

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
        target: Target | None = None,
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
        ctx = self._sources.context()
        failed: list[int] = []
        problems: list[str] = []
        for s in candidates:
            t1 = time.perf_counter()
            got = fetch_step(s, table, ctx, target)
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
            report = RestoreReport(
                s,
                labels,
                got.bytes_moved,
                failed,
                phases,
                problems + got.problems,
                reasons,
                got.in_place,
            )
            self._record(report, time.perf_counter() - t0)
            return Outcome(got.state, report, got)
        garbage = (
            "; the tensors passed as load(into=...) may hold bytes of the failed attempts: "
            "do not train on them"
            if failed and target is not None
            else ""
        )
        if failed and mode is RecoveryMode.RECOVERY_VERIFIED:
            raise NoConsistentStep(
                f"every verified step failed validation (tried {failed}): {'; '.join(problems)}; "
                "failing closed (RECOVERY_VERIFIED never falls back to unverified state)" + garbage
            )
        why = (
            f"every common step failed validation (tried {failed})"
            if failed
            else "no step is available on every rank"
        )
        self._say_nothing(reports, mode, why)
        if fallback is not None:
            report = RestoreReport(
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
            "load_fallback=<load your durable checkpoint> to recover from it" + garbage
        )

    def _record(self, report: RestoreReport, seconds: float) -> None:
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

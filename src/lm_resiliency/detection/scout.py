"""``Scout``: SCOUT for one rank - checks, capture vetoes and certification.

Call order on every rank (the plain training loop with GEMINI)::

    scout = Scout(ScoutConfig(), model, manager=manager.trust, interval=manager.config.interval)
    for step in range(1, max_steps + 1):
        loss = model(batch).backward(); manager.maybe_wait()
        optimizer.step(); optimizer.zero_grad()
        if step % manager.config.interval == 0:
            if scout.before_capture(step):       # collective: a check at this boundary
                manager.save(state(), step)
                scout.after_capture(step)        # local: certify the capture
        else:
            scout.maybe_check(step)              # collective; only if a class is due
    scout.close()

Collective calls (every rank, same steps, same order): the constructor,
:meth:`check`, :meth:`maybe_check`, :meth:`before_capture`, :meth:`sweep`,
:meth:`close`. Local: :meth:`after_capture`, :meth:`recovered`. Checks run at step
boundaries (after ``optimizer.step()``), never inside a forward/backward.

Pipelined verdict (the default, ``ScoutConfig(pipeline=True)``, with a sink that
holds captures): the boundary's verdict resolves at the next ``manager.maybe_wait()``
or SCOUT call; until then the capture is held uncommitted and ``last_result`` is
the previous check's (``pending`` names the step). :meth:`post_check` (the front
door's hook between captures) pipelines the other checks the same way.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.capture.gate import CommitGate
from lm_resiliency.detection.assess import Assessment, assess, check_consistent
from lm_resiliency.detection.blocks import partition, structure_fingerprint, uncovered_params
from lm_resiliency.detection.certify import Certifier, TrustSink
from lm_resiliency.detection.compose import blocked, compose, severity
from lm_resiliency.detection.coverage import Coverage
from lm_resiliency.detection.execute import Executed, Executor
from lm_resiliency.detection.fingerprint import config_fingerprint
from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.planner import Planner
from lm_resiliency.detection.recipes import Cycles, DynamicCatalog
from lm_resiliency.detection.result import CHECK_EVENT, ScoutResult, ScoutStatus
from lm_resiliency.detection.saved_catalog import CatalogKeeper, layout_of
from lm_resiliency.detection.scout_config import ScoutConfig
from lm_resiliency.detection.signature import Recorder
from lm_resiliency.detection.verdict import Outcome, StragglerRule
from lm_resiliency.detection.wire import (
    CLASSES,
    Channel,
    Flags,
    PendingReports,
    PendingSpec,
    RankReport,
)
from lm_resiliency.errors import ConfigError, ResiliencyError
from lm_resiliency.persistence.trust import TrustStatus
from lm_resiliency.telemetry import EventLog

log = logging.getLogger(__name__)

#: After this many non-reproducible replays a block is no longer replayed.
_NONDETERMINISTIC_LIMIT = 2
_DEFAULT_INTERVAL = 10


@dataclass
class _Inflight:
    """A check whose replay ran and whose group exchange is posted, awaiting its verdict."""

    step: int
    classes: set[str]
    spec: dict[str, Any]
    done: Executed
    reports: PendingReports
    t0: float
    bytes0: int
    timings: dict[str, float] = field(default_factory=dict)
    gate: CommitGate | None = None
    captured: bool = False
    """``after_capture(step)`` ran: certify the capture when the verdict is clean."""
    judged: tuple[Any, ...] | None = None
    """After :meth:`Scout._judge`: the assessment, the reports, the state to undo for a
    re-run, and the flags all-reduce in flight."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module a data-parallel wrapper holds (``DistributedDataParallel.module``)."""
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and isinstance(
        inner, nn.Module
    ):
        return inner
    return model


class Scout:
    """SCOUT on one rank. See the module docstring for the call order.

    ``manager``: the GEMINI manager's trust ledger (``manager.trust``, or any
    :class:`TrustSink`) that certification drives; ``None`` checks without
    certifying. ``groups``: the comparison groups (default: every rank is a DDP
    peer). ``dynamic``: a dynamic catalog (MoE experts). ``interval``: GEMINI's
    capture interval, the default of every class.
    ``on_candidate(step)``: the framework's durable-candidate writer, called on
    the training thread when a step becomes CANDIDATE (keep it asynchronous);
    ``on_verified(step)`` / ``on_rejected(step)``: told when such a step becomes
    RECOVERY_VERIFIED or is rejected (see :class:`~lm_resiliency.detection.certify.Certifier`).
    ``events``: the structured log for ``scout.check`` events.

    Raises ``ConfigError`` when torch.distributed is not initialized, when a
    group has fewer than two ranks, or when peers of a group run a different
    model structure or configuration.
    """

    def __init__(
        self,
        config: ScoutConfig,
        model: nn.Module,
        *,
        manager: TrustSink | None = None,
        groups: ComparisonGroups | None = None,
        dynamic: DynamicCatalog | None = None,
        interval: int | None = None,
        on_candidate: Callable[[int], None] | None = None,
        on_verified: Callable[[int], None] | None = None,
        on_rejected: Callable[[int], None] | None = None,
        events: EventLog | None = None,
    ) -> None:
        if not isinstance(config, ScoutConfig):
            raise ConfigError(f"config={config!r} must be a ScoutConfig")
        self.config = config
        self.model = unwrap(model)
        self.events = events
        self.last_result: ScoutResult | None = None
        self._closed = False
        if dynamic is not None and config.catalog is not None and dynamic is not config.catalog:
            raise ConfigError(
                "two dynamic catalogs: Scout(dynamic=...) and ScoutConfig(catalog=...); give "
                "the catalog once (ScoutConfig(catalog=DynamicCatalog(...)))"
            )
        dynamic = dynamic if dynamic is not None else config.catalog
        default = interval if interval is not None else _DEFAULT_INTERVAL
        if isinstance(default, bool) or not isinstance(default, int) or default < 1:
            raise ConfigError(f"interval={interval!r} must be a positive int (GEMINI's interval)")
        dyn_on = dynamic is not None and config.dynamic.enabled
        self.intervals = {
            name: config.class_interval(name, default) for name in ("dense", "optimizer")
        }
        self.intervals["dynamic"] = config.class_interval("dynamic", default) if dyn_on else None
        self.certifier = Certifier(
            manager,
            dynamic=dyn_on,
            persist=config.persist_certified,
            on_candidate=on_candidate,
            on_verified=on_verified,
            on_rejected=on_rejected,
        )
        if not config.enable:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "SCOUT compares replicas across ranks: call torch.distributed.init_process_group "
                "on every rank before building Scout (or use ScoutConfig(enable=False))"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.groups = groups if groups is not None else ComparisonGroups.ddp(self.world_size)
        if self.groups.world_size != self.world_size:
            raise ConfigError(
                f"comparison groups cover world_size={self.groups.world_size}, but the job has "
                f"{self.world_size} ranks"
            )
        self.blocks = partition(self.model)
        self.channel = Channel(self.groups, rank=self.rank, timeout_s=config.timeout_s)
        self.is_source = self.channel.source == self.rank
        recorders: list[Recorder] = []
        self.recorder = self.dynamic_recorder = None
        if self.is_source:
            self.recorder = Recorder(
                [b.module for b in self.blocks], count_distinct=False, one_shot=True
            )
            recorders.append(self.recorder)
            if dyn_on and dynamic is not None:
                self.dynamic_recorder = Recorder(
                    dynamic.modules, count_distinct=dynamic.shapes is None
                )
                recorders.append(self.dynamic_recorder)
        self.dynamic = dynamic if dyn_on else None
        self.planner = Planner(
            self.blocks, self.recorder, self.dynamic, self.dynamic_recorder, seed=config.seed
        )
        # The source saves what it records with the trust records, so that a restarted
        # job can sweep before its first forward (docs/scout.md, "Recovery decisions").
        self.catalog = CatalogKeeper(
            manager if self.is_source else None,
            layout=layout_of(self.blocks, self.dynamic),
            recorder=self.recorder,
            dynamic=self.dynamic,
        )
        self.planner.saved = self.catalog.load(len(self.blocks))
        self.coverage = Coverage(
            self.blocks,
            self.groups,
            classes={n for n, every in self.intervals.items() if every is not None},
            disabled=self.planner.disabled,
        )
        self.executor = Executor(
            self.blocks, uncovered_params(self.model, self.blocks), self.dynamic, recorders
        )
        self.rule = StragglerRule(
            config.straggler_mad_factor, config.straggler_floor_s, config.straggler_min_slowdown
        )
        self.fingerprint = config_fingerprint(self.model, structure_fingerprint(self.blocks))
        self._agree_fingerprint()
        self._seq = 0
        self._pending: PendingSpec | None = None
        self._pending_capture: int | None = None
        self._inflight: _Inflight | None = None
        self._frontier_value = -math.inf
        sink_hold = getattr(manager, "hold", None) if config.pipeline else None
        self._hold: Callable[[int, Callable[[], object]], CommitGate] | None = sink_hold
        self._last_check: ScoutResult | None = None  # regular checks only (not sweeps)
        self.cycles = Cycles(self.groups)
        self._nondeterministic: Counter[int] = Counter()
        if self.rank == 0:
            log.info(
                "SCOUT: %d blocks, groups %s, intervals %s",
                len(self.blocks),
                self.groups.describe(),
                self.intervals,
            )

    def _agree_fingerprint(self) -> None:
        rows = self.channel.gather_u64([self.fingerprint])
        for g in self.groups.groups:
            values = {rows[r][0] for r in g}
            if len(values) != 1:
                raise ConfigError(
                    f"SCOUT peers {list(g)} differ in model structure or configuration (torch "
                    "version, device, CPU threads, block shapes); replicas must run identically. "
                    "Fingerprints: " + ", ".join(f"rank {r}: {rows[r][0]:016x}" for r in g)
                )

    # -- schedule ----------------------------------------------------------------------

    def due(self, step: int) -> set[str]:
        """The recipe classes whose interval divides ``step``."""
        return {n for n, every in self.intervals.items() if every is not None and step % every == 0}

    def _boundary_classes(self, step: int) -> set[str]:
        classes = self.due(step)
        if not classes & {"dense", "optimizer"}:
            # A capture needs an accepted result at its own step: run the dense recipes.
            classes |= {n for n in ("dense", "optimizer") if self.intervals[n] is not None}
        return classes

    # -- public API ---------------------------------------------------------------------

    def check(self, step: int) -> ScoutResult:
        """Collective: run one check now (the due classes; at least dense and optimizer)."""
        self._check_open()
        if not self.config.enable:
            return self._disabled(step)
        return self._check(step, self._boundary_classes(step))

    def maybe_check(self, step: int) -> ScoutResult | None:
        """Collective: run a check if a recipe class is due at ``step``; else ``None``."""
        self._check_open()
        if not self.config.enable:
            return None
        classes = self.due(step)
        return self._check(step, classes) if classes else None

    def post_check(self, step: int) -> None:
        """Collective: :meth:`maybe_check`, pipelined like a boundary's check when it is.

        With the pipelined verdict (see :meth:`before_capture`) the check replays,
        judges its group and posts the flags all-reduce now; its verdict resolves at
        the next :meth:`resolve` (the front door calls it in every pre-step hook) or
        SCOUT call, and ``last_result`` is the previous check's until then. So every
        check resolves one step later and each verdict is ``last_result`` after the
        next ``optimizer.step()``, boundaries included (a synchronous check at the
        next step would resolve the boundary's verdict and replace it within one
        hook). Otherwise the same as :meth:`maybe_check`. The front door's hook
        between captures.
        """
        self._check_open()
        if not self.config.enable:
            return
        classes = self.due(step)
        if classes:
            self._check(step, classes, pipelined=self._hold is not None)

    def before_capture(self, step: int) -> bool:
        """Collective: check at this capture boundary; True when the capture may proceed.

        Reuses a check already run at ``step``. False after SDC or an inconclusive
        comparison (then the current candidate is rejected and verified recovery is
        required, job-wide), while latched after an earlier SDC, or when no
        recipe produced evidence.
        """
        self._check_open()
        if not self.config.enable:
            return True
        last = self._last_check
        if last is not None and last.step == step and self._inflight is None:
            allowed = last.capture_allowed
        elif self._hold is not None:
            # Pipelined: replay now, post the exchange, resolve at the next pre-step hook
            # (or the next SCOUT call); the capture is held uncommitted until then.
            self._check(step, self._boundary_classes(step), pipelined=True)
            inflight = self._inflight
            allowed = self.latched is None and inflight is not None
            if allowed and inflight is not None:
                inflight.gate = self._hold(step, self.resolve)
            elif inflight is not None:
                # Latched: no capture to hold, so no pre-step hook would resolve it.
                self._resolve()
        else:
            allowed = self.check(step).capture_allowed
        self._pending_capture = step if allowed else None
        return allowed

    @property
    def pending(self) -> int | None:
        """The step of a check whose verdict is not resolved yet, or ``None``."""
        return None if self._inflight is None else self._inflight.step

    def resolve(self) -> ScoutResult | None:
        """Collective: resolve the pending verdict (pipelined boundary check) now, if any.

        Decides the held capture (commit, or discard on SDC / no evidence) and
        certifies it. The manager calls it from ``maybe_wait`` and before the next
        capture; every SCOUT call resolves first. Returns the resolved result.
        """
        if self._closed or not self.config.enable or self._inflight is None:
            return None
        return self._resolve()

    def after_capture(self, step: int) -> None:
        """Local: certify the capture just taken at ``step`` (after ``manager.save``).

        Dense: ``RECOVERY_VERIFIED`` when every recipe was checked clean at or after
        ``step`` (one signature: at once), else a persisted ``CANDIDATE`` that a later
        check promotes; dynamic: ``CANDIDATE`` after a complete cycle (promoting the
        previous candidate once the dense recipes cover it too). Persistence runs in
        the background.
        Raises ``ResiliencyError`` without a permitting ``before_capture(step)``.
        """
        self._check_open()
        if not self.config.enable:
            return
        if self._pending_capture != step:
            raise ResiliencyError(
                f"after_capture({step}) without a permitting before_capture({step}); call "
                "before_capture at the boundary and capture only when it returns True"
            )
        self._pending_capture = None
        self.catalog.maybe_save(self.planner.snapshot)
        inflight = self._inflight
        if inflight is not None and inflight.step == step:
            inflight.captured = True  # certified when its verdict resolves
            return
        self._certify_capture(step)

    def _certify_capture(self, step: int) -> None:
        trust = self.certifier.captured(step, frontier=self._frontier())
        if trust is TrustStatus.CANDIDATE and not self.certifier.dynamic:
            log.debug("SCOUT: step %d is a CANDIDATE until every recipe is checked clean", step)
            waiting = len(self.certifier.pending)
            if waiting == 2 * len(self.blocks) + 1 and self.rank == 0:
                # Two rotations without a promotion: a recipe is never checked clean.
                log.warning(
                    "SCOUT: %d captures in a row stay CANDIDATE (none can be verified): "
                    "not checked clean since step %d: %s. A block that is disabled or no "
                    "longer called in a forward keeps every capture a candidate.",
                    waiting,
                    self.certifier.pending[0],
                    ", ".join(self.coverage.behind(self.certifier.pending[0])[:8]),
                )

    def recovered(self, step: int, *, verified: bool) -> None:
        """Local: the state of ``step`` was restored (``verified``: a RECOVERY_VERIFIED step).

        A verified recovery unlatches SCOUT after an SDC; the persisted verdict is
        cleared at the next certification. Call on every rank.
        """
        self.certifier.recovered(step, verified=verified)
        if self.config.enable:
            self.coverage.reset()  # clean checks of the abandoned timeline say nothing now
            self._frontier_value = -math.inf
        log.info("SCOUT: recovered step %d (verified=%s)", step, verified)

    def sweep(self, step: int = 0, *, warmup: Callable[[], Any] | None = None) -> ScoutResult:
        """Collective: replay the full enabled catalog (every block, every dynamic recipe).

        For recovery after a hang: ``result.complete_cycle`` is True only when
        every recipe was replayed and compared clean in every group. Blocks never
        seen in a forward replay the shapes a previous process saved with the trust
        records (``saved_catalog``); without those (a fresh process and no saved
        catalog) pass ``warmup`` (one forward on a representative batch) or the
        sweep is incomplete.
        """
        self._check_open()
        if not self.config.enable:
            return self._disabled(step)
        self.resolve()
        if warmup is not None:
            with torch.no_grad():
                warmup()
        classes = {n for n in ("dense", "optimizer", "dynamic") if self.intervals[n] is not None}
        return self._sweep(step, classes)

    @property
    def latched(self) -> str | None:
        """Why captures are blocked after an SDC (until a verified recovery), or ``None``."""
        return self.certifier.latched

    def close(self) -> None:
        """Remove SCOUT's hooks and groups. Collective (destroys process groups)."""
        if self._closed:
            return
        if not self.config.enable:
            self._closed = True
            return
        try:
            if self._inflight is not None:
                self._resolve()  # every rank has the same check in flight
        finally:
            self._closed = True
        if self._pending is not None:
            self._pending.result()  # every rank has the same broadcast in flight
            self._pending = None
        for r in self.executor.recorders:
            r.remove()
        self.channel.close()

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ResiliencyError("this Scout is closed; create a new one")

    def _disabled(self, step: int) -> ScoutResult:
        return ScoutResult(step=step, status=ScoutStatus.HEALTHY, reason="SCOUT disabled")

    def _spec(self, plan: Callable[[], dict[str, Any]]) -> PendingSpec:
        """Collective in the group: the source plans (``plan``) and broadcasts a spec."""
        return self.channel.send_spec(plan() if self.is_source else None)

    def _next_regular_spec(self) -> PendingSpec:
        """Plan the next regular check's spec now; it travels while training runs."""
        gi = self.groups.index_of(self.rank)
        enabled = {n for n, every in self.intervals.items() if every is not None}
        seq = self._seq + 1
        return self._spec(
            lambda: self.planner.plan(seq=seq, classes=enabled, progress=self.cycles.progress[gi])
        )

    def _post(self, step: int, spec: dict[str, Any], classes: set[str]) -> _Inflight:
        """Replay ``spec`` (its ``classes``) and post the group's report all-gather."""
        t0 = time.perf_counter()
        bytes0 = self.channel.bytes_exchanged
        done = self.executor.run(spec, classes)
        t1 = time.perf_counter()
        posted = self.channel.post_reports(self._report(step, done))
        timings = {"replay": t1 - t0, "exchange": 0.0, "post": time.perf_counter() - t1}
        return _Inflight(step, classes, spec, done, posted, t0, bytes0, timings)

    def _judge(self, inf: _Inflight) -> None:
        """Wait for the group's reports, judge the group, post the job's flags all-reduce.

        The group all-gather waits for the group's slowest replay (bounded by the
        group's size); the all-reduce over the job travels in the background until
        :meth:`_settle` (the next pre-step hook when pipelined).
        """
        if inf.judged is not None:
            return
        t0 = time.perf_counter()
        first = inf.reports.result()
        check_consistent(first, self.groups)
        a = assess(first, self.groups, self.rule)
        saved = self.coverage.snapshot(), self.cycles.snapshot()
        pending = self.channel.post_agree(self._flags(inf, a, first).words())
        inf.judged = (a, first, saved, pending)
        inf.timings["exchange"] += time.perf_counter() - t0

    def _settle(self, inf: _Inflight) -> tuple[Assessment, dict[int, RankReport], Flags, bool]:
        """The job-wide verdict of ``inf``: its flags; a re-run (job-wide) on anomalies."""
        self._judge(inf)
        assert inf.judged is not None
        t0 = time.perf_counter()
        a, first, saved, pending = inf.judged
        flags = self._agreed(pending.result())
        rerun = flags.anomaly
        if rerun:  # decided job-wide: a replay may be collective (FSDP2 all-gathers)
            self.coverage.restore(saved[0])
            self.cycles.restore(saved[1])
            t1 = time.perf_counter()
            again = self.executor.run(inf.spec, inf.classes)
            t2 = time.perf_counter()
            second = self.channel.gather_reports(self._report(inf.step, again))
            inf.timings["replay"] += t2 - t1
            t0 += t2 - t1
            a = assess(first, self.groups, self.rule, second)
            flags = self._agreed(self.channel.agree(self._flags(inf, a, first).words()))
        inf.timings["exchange"] += time.perf_counter() - t0
        for cls, text in inf.done.errors.items():
            log.warning("rank %d: SCOUT %s replay failed: %s", self.rank, cls, text)
        return a, first, flags, rerun

    def _flags(self, inf: _Inflight, a: Assessment, reports: dict[int, RankReport]) -> Flags:
        """Credit this group's recipes and cycle; this rank's contribution to the flags."""
        gi = self.groups.index_of(self.rank)
        self.coverage.credit(inf.step, a, reports, inf.classes)
        sdc, inconclusive = bool(a.outcomes(Outcome.SDC)), bool(a.outcomes(Outcome.INCONCLUSIVE))
        own_done = True
        if "dynamic" in inf.classes:
            own_done = self.cycles.advance(a, reports, sdc or inconclusive)
        dense = a.verdicts[(gi, "dense")]
        block = reports[self.groups.groups[gi][0]].of("dense").recipe
        failed = "failed on every peer" in dense.detail
        unreplayable = dense.outcome is Outcome.NO_EVIDENCE and failed
        return Flags(
            sdc=sdc,
            inconclusive=inconclusive,
            anomaly=a.anomalies(),
            no_evidence=not any(a.verdicts[(gi, n)].outcome is Outcome.CLEAN for n in CLASSES),
            straggler=bool(a.suspects),
            cycle_done=own_done,
            frontier=self.coverage.frontier(gi),
            seq=(self._seq, self._seq),
            step=(inf.step, inf.step),
            nondeterministic=block if dense.outcome is Outcome.NONDETERMINISTIC else -1,
            unreplayable=block if unreplayable else -1,
            corrupt_group=gi if sdc or inconclusive else -1,
        )

    @staticmethod
    def _agreed(words: list[int]) -> Flags:
        job = Flags.of_words(words)
        if job.seq[0] != job.seq[1] or job.step[0] != job.step[1]:
            raise ResiliencyError(
                f"SCOUT ranks are at different checks: sequence {job.seq[0]}..{job.seq[1]}, step "
                f"{job.step[0]}..{job.step[1]}; every rank must call check/before_capture at "
                "the same steps"
            )
        return job

    def _job_wide(self, result: ScoutResult, flags: Flags) -> ScoutResult:
        """This group's result with what the other groups found (from the flags)."""
        status, reasons = result.status, [result.reason] if result.reason else []
        where = "another comparison group"
        if flags.corrupt_group >= 0:
            where = f"comparison group {list(self.groups.groups[flags.corrupt_group])}"
        if flags.sdc and status is not ScoutStatus.SDC:
            status = ScoutStatus.SDC
            reasons.append(f"SDC found in {where}")
        elif flags.inconclusive and not status.corrupt:
            status = ScoutStatus.INCONCLUSIVE
            reasons.append(f"inconclusive comparison in {where}")
        elif flags.straggler and status is ScoutStatus.HEALTHY and not result.stragglers:
            status = ScoutStatus.STRAGGLER
            reasons.append("straggler in another comparison group")
        allowed = not flags.no_evidence and not (flags.sdc or flags.inconclusive)
        if flags.no_evidence and result.capture_allowed:
            reasons.append("no recipe produced evidence in some group: the capture waits")
        return replace(result, status=status, capture_allowed=allowed, reason="; ".join(reasons))

    def _report(self, step: int, done: Executed) -> RankReport:
        return RankReport(self._seq, step, self.fingerprint, self.latched is not None, done.reports)

    def _check(self, step: int, classes: set[str], *, pipelined: bool = False) -> ScoutResult:
        self.resolve()
        t0 = time.perf_counter()
        bytes0 = self.channel.bytes_exchanged  # the spec travelled for this check
        pending = self._pending if self._pending is not None else self._next_regular_spec()
        self._pending = None
        self._seq += 1
        spec = pending.result()
        wait_s = time.perf_counter() - t0
        inf = self._post(step, spec, classes)
        inf.t0, inf.bytes0, inf.timings["exchange"] = t0, bytes0, wait_s
        self._inflight = inf
        if pipelined:
            self._judge(inf)  # the group's verdict now; the job's flags travel meanwhile
            return ScoutResult(step=step, status=ScoutStatus.HEALTHY, reason="verdict pending")
        return self._resolve()

    def _resolve(self) -> ScoutResult:
        inf = self._inflight
        assert inf is not None
        self._inflight = None
        step, classes = inf.step, inf.classes
        try:
            a, _, flags, rerun = self._settle(inf)
        except BaseException:
            if inf.gate is not None:
                inf.gate.decide(False, "the SCOUT exchange failed")
            raise
        self._learn(flags)
        corrupt = flags.sdc or flags.inconclusive
        cycle = False
        if "dynamic" in classes:
            if corrupt:
                self.cycles.reset()
            elif flags.cycle_done:
                self.cycles.complete()
                cycle = True
        frontier = -math.inf if self.planner.disabled else flags.frontier
        timings = {**inf.timings, "total": time.perf_counter() - inf.t0}
        result = compose(
            step,
            a,
            self.groups,
            labels=inf.done.labels,
            timings=timings,
            bytes_exchanged=self.channel.bytes_exchanged - inf.bytes0,
            rerun=rerun,
            cycle=cycle,
        )
        result = self._job_wide(result, flags)
        self.certifier.observe(
            step,
            corrupt=result.status.corrupt,
            reason=result.reason,
            cycle_complete=cycle,
            frontier=frontier,
        )
        if self.latched is not None and result.capture_allowed:
            result = blocked(result, self.latched)
        self._frontier_value = frontier
        if inf.gate is not None:
            inf.gate.decide(result.capture_allowed, result.reason or "refused")
        committed = inf.gate is None or inf.gate.accepted is True
        if inf.captured and result.capture_allowed and committed:
            self._certify_capture(step)
        self._pending = self._next_regular_spec()
        if self.recorder is not None:
            self.recorder.rearm()  # fresh shapes from the next forward, for the check after
        self._last_check = result
        return self._record(result)

    def _sweep(self, step: int, classes: set[str]) -> ScoutResult:
        t0 = time.perf_counter()
        bytes0 = self.channel.bytes_exchanged
        gi = self.groups.index_of(self.rank)
        size = 0  # this group's dynamic catalog size (learnt in round 0)
        rounds, r = max(len(self.blocks), 1), 0
        missing: list[str] = []
        worst: ScoutResult | None = None
        timings = {"replay": 0.0, "exchange": 0.0}
        frontier = -math.inf
        while r < rounds:
            self._seq += 1
            seq, round_ = self._seq, r

            def plan(seq: int = seq, round_: int = round_) -> dict[str, Any]:
                return self.planner.plan_sweep(seq=seq, round_=round_, classes=classes)

            spec = self._spec(plan).result()
            inf = self._post(step, spec, classes)
            a, reports, flags, rerun = self._settle(inf)
            self._learn(flags)
            frontier = flags.frontier
            if r == 0 and "dynamic" in classes:
                size = reports[self.groups.groups[gi][0]].of("dynamic").extra
                rounds = max(rounds, self.channel.agree_max([size])[0])
                if not size:
                    missing.append(f"group {gi}: empty dynamic catalog")
            for key in ("replay", "exchange"):
                timings[key] += inf.timings[key]
            wanted = []
            if "dense" in classes and r < len(self.blocks):
                wanted.append("dense")
            if "optimizer" in classes and r < len(self.blocks):
                wanted.append("optimizer")
            if "dynamic" in classes and r < size:
                wanted.append("dynamic")
            for name in wanted:
                if a.verdicts[(gi, name)].outcome is not Outcome.CLEAN:
                    missing.append(f"group {gi} {name} round {r}")
            res = compose(
                step,
                a,
                self.groups,
                labels=inf.done.labels,
                timings=inf.timings,
                bytes_exchanged=0,
                rerun=rerun,
                cycle=False,
            )
            res = self._job_wide(res, flags)
            if worst is None or severity(res.status) > severity(worst.status):
                worst = res
            r += 1
        assert worst is not None
        incomplete = bool(self.channel.agree_max([int(bool(missing))])[0])
        complete = not incomplete and not worst.status.corrupt
        if worst.reason:
            reason = worst.reason
        elif complete:
            reason = f"complete clean sweep of {r} rounds"
        elif missing:
            reason = f"incomplete sweep, no evidence for: {', '.join(missing[:6])}"
        else:
            reason = "incomplete sweep: no evidence in another comparison group"
        result = ScoutResult(
            step=step,
            status=worst.status,
            faulty_ranks=worst.faulty_ranks,
            stragglers=worst.stragglers,
            recipe=f"sweep of {r} rounds",
            timings={**timings, "total": time.perf_counter() - t0},
            bytes_exchanged=self.channel.bytes_exchanged - bytes0,
            capture_allowed=worst.capture_allowed,
            reason=reason,
            rerun=worst.rerun,
            complete_cycle=complete,
            groups=worst.groups,
        )
        self._frontier_value = -math.inf if self.planner.disabled else frontier
        self.certifier.observe(
            step,
            corrupt=result.status.corrupt,
            reason=reason,
            cycle_complete=False,
            frontier=self._frontier(),
        )
        return self._record(result)

    def _frontier(self) -> float:
        """The newest step every recipe was checked clean at or after, in every group.

        As agreed by the last check's flags (see Coverage; each rank knows its own group).
        """
        return self._frontier_value

    def _learn(self, flags: Flags) -> None:
        """Disable blocks that cannot be replayed (the same block on every rank)."""
        block = flags.nondeterministic
        if block >= 0:
            self._nondeterministic[block] += 1
            if self._nondeterministic[block] >= _NONDETERMINISTIC_LIMIT:
                self._disable(block, "not reproducible on this device (twice)")
        if flags.unreplayable >= 0:
            self._disable(flags.unreplayable, "its replay failed on every peer")

    def _disable(self, block: int, why: str) -> None:
        if block in self.planner.disabled or not 0 <= block < len(self.blocks):
            return
        self.planner.disabled.add(block)
        if self.rank == 0:
            log.warning(
                "SCOUT no longer replays block %d (%s): %s. Its recipe can never be checked "
                "again, so every capture from now on stays a CANDIDATE (never "
                "RECOVERY_VERIFIED) in this process; verified recovery returns the newest "
                "step verified before.",
                block,
                self.blocks[block].label,
                why,
            )

    def _record(self, result: ScoutResult) -> ScoutResult:
        self.last_result = result
        level = logging.WARNING if result.status is not ScoutStatus.HEALTHY else logging.DEBUG
        wanted = log.isEnabledFor(level)
        if self.events is not None or wanted:
            event = result.to_event()
            if self.events is not None:
                self.events.log(CHECK_EVENT, **event)
            if wanted:
                log.log(level, "%s %s", CHECK_EVENT, json.dumps({"rank": self.rank, **event}))
        return result

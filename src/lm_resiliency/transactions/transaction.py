"""MTGS: every training step is a transaction that commits on every rank or on none.

Call order (every rank, every step)::

    txn = MTGS(ddp_model, optimizer, scheduler, config=MTGSConfig())
    for batch in batches:
        result = txn.step(lambda: loss_fn(ddp_model(batch.x), batch.y))

One :meth:`MTGS.step` runs:

1. **begin** — snapshot the RNG states and the data position; launch the
   shadow copy (it overlaps the forward and backward passes).
2. **forward + backward** — ``closure()`` (must call the DDP model exactly
   once and return the loss), then ``loss.backward()``. Exceptions (out of
   memory included), a non-finite loss, a failed health check or a forced
   abort make this rank vote "abort"; a rank that raised completes its share
   of the step's collectives with zero gradients so nobody blocks.
3. **vote** — folded into the gradient all-reduce by the comm hook (zero extra
   collectives): every rank reads every rank's code once, after backward.
   Any code means abort: gradients are discarded on every rank, the RNG and
   data position are restored, and the same closure runs again. No parameter
   was modified, so nothing else needs restoring.
4. **commit** — ``optimizer.step()``, ``scheduler.step()``, the post-step
   check; then (``two_phase_commit``) one tiny all-reduce confirms every rank
   applied it. If any rank failed, every rank restores the shadow and retries.

After ``max_retries`` retries the step raises :class:`StepAborted` on every
rank (or is skipped, per ``on_exhausted``), with the parameters as they were
before the step. A dead or hung peer makes the step's collective fail within
the process group's timeout (or ``collective_timeout_s`` for MTGS's own
collectives); the survivors then restore the pre-step state and raise
:class:`StepAborted` (peer lost) or :class:`CollectiveTimeout` (no answer), so
the launcher restarts the job and GEMINI recovers it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.errors import (
    CaptureError,
    CollectiveTimeout,
    ConfigError,
    ResiliencyError,
    StepAborted,
)
from lm_resiliency.faults import FaultInjector
from lm_resiliency.rng import RngState
from lm_resiliency.telemetry import EttrTimer, EventLog
from lm_resiliency.transactions import fallback, health, memory_health
from lm_resiliency.transactions.hook import MTGSState, mtgs_comm_hook
from lm_resiliency.transactions.mtgs_config import ExhaustedPolicy, MTGSConfig
from lm_resiliency.transactions.reasons import AbortReason, decode_codes, describe, reason_names
from lm_resiliency.transactions.reducer import (
    LossReport,
    MembershipLoss,
    Reducer,
    exchange_live,
    live_codes,
)
from lm_resiliency.transactions.result import AbortRecord, MembershipChange, StepResult
from lm_resiliency.transactions.shadow import Shadow
from lm_resiliency.transactions.tracer import Span, Tracer
from lm_resiliency.transactions.vote import CollectiveCounter, exchange_codes

HealthCheck = Callable[[torch.Tensor], "bool | torch.Tensor"]


class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()`` (a data iterator's position)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _AbortedError(Exception):
    """Internal: the current attempt was aborted on every rank (codes are identical)."""

    def __init__(self, phase: str, codes: dict[int, int], detected_ns: int) -> None:
        super().__init__(phase)
        self.phase = phase
        self.codes = codes
        self.detected_ns = detected_ns


class _MembershipChanged(Exception):
    """Internal (live mode): a collective of this attempt lost a replica; reform and redo."""

    def __init__(self, operation: str, cause: str, detected_ns: int) -> None:
        super().__init__(operation)
        self.operation = operation
        self.cause = cause
        self.detected_ns = detected_ns


class MTGS:
    """Step transactions for one DDP model, its optimizer and optional LR scheduler.

    Construct on every rank after the DDP model and the optimizer, before the
    first step. MTGS registers :func:`mtgs_comm_hook` on the model unless you
    registered it yourself and pass its ``hook_state``, or ``vote_in_hook=False``
    (no hook at all: the model keeps DDP's all-reduce or the hook you register). ``scaler`` (an AMP
    ``GradScaler``) scales the loss and steps the optimizer; its own overflow
    handling then owns non-finite gradients (they skip the update instead of
    aborting the step). ``data_state`` is restored with the RNG before every
    retry, so a closure that pulls its own batch gets the same batch again.
    ``health_check(loss)`` returns ``False`` (or a false boolean tensor, read
    without a host sync) to vote abort. ``committed_steps`` is the number of
    steps already done (after a restart); step numbers are 1-based. ``tracer``
    (a :class:`~lm_resiliency.transactions.tracer.Tracer`) records one event per
    phase (shadow, sync, vote, commit, abort, rollback).

    ``reducer`` (default: the DDP model's group, today's behaviour) is where the comm hook
    and the commit confirmation reduce (:mod:`lm_resiliency.transactions.reducer`). With a
    *live* reducer a lost replica is a membership change, not the end of the job: the step
    is aborted on every survivor, the reducer reforms under the next epoch and the step is
    redone (at most ``max_membership_changes`` times per step, default the reducer's
    ``slots``; they do not count against ``max_retries``). Live mode needs
    ``two_phase_commit`` and ``shadow``.

    Raises ``ConfigError`` for a model MTGS cannot make atomic (not DDP,
    ``find_unused_parameters``, ``static_graph``, another comm hook).
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        config: MTGSConfig | None = None,
        scaler: Any = None,
        data_state: Stateful | None = None,
        health_check: HealthCheck | None = None,
        hook_state: MTGSState | None = None,
        faults: FaultInjector | None = None,
        events: EventLog | None = None,
        ettr: EttrTimer | None = None,
        committed_steps: int = 0,
        reducer: Reducer | None = None,
        max_membership_changes: int | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"MTGS needs a DistributedDataParallel model, got {type(model).__name__}; "
                "wrap it with torch.nn.parallel.DistributedDataParallel first"
            )
        fallback.check_supported(model)
        self.config = config if config is not None else MTGSConfig()
        if not isinstance(self.config, MTGSConfig):
            raise ConfigError(f"config must be an MTGSConfig, got {type(self.config).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.data_state = data_state
        self.health_check = health_check
        self.faults = faults
        self.events = events
        self.group = model.process_group
        self.reducer = reducer
        self._live = reducer is not None and reducer.live
        self.max_membership_changes = _membership_budget(
            reducer, max_membership_changes, self.config
        )
        self.membership_changes = 0
        """Membership changes this transaction went through (every step together)."""
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ettr = ettr if ettr is not None else EttrTimer(self.rank)
        self.committed_steps = committed_steps
        self.counters = CollectiveCounter()
        self.local_repairs = 0
        """Updates this rank redid from its shadow without 2PC (each also an ETTR ``rollback``)."""
        self._last_loss = torch.zeros(())
        self._local_error: str | None = None
        self._current_attempt = 0
        self._applied = False
        self._params = [p for p in model.module.parameters() if p.requires_grad]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self.tracer = tracer
        self._shadow_span: Span | None = None
        self._grad_marks: dict[int, tuple[int, int]] | None = None
        # vote_in_hook=False registers no comm hook (DDP's own all-reduce, or the user's hook)
        self._hook_registered = hook_state is not None or self.config.vote_in_hook
        self.hook = self._register_hook(hook_state)
        self.probe = fallback.ForwardProbe(model)
        self.shadow = (
            Shadow(
                list(model.module.parameters()),
                optimizer,
                scheduler,
                scaler,
                module=model.module,
                pin=self.config.pin_shadow,
            )
            if self.config.shadow
            else None
        )

    # -- public ----------------------------------------------------------------

    def step(self, closure: Callable[..., torch.Tensor], *, micro_batches: int = 1) -> StepResult:
        """Run one step as a transaction; see the module doc for the protocol.

        Collective: every rank calls it once per step. With ``micro_batches=k > 1``
        gradients are accumulated over ``k`` micro-batches: ``closure(i)``
        (``i`` = 0..k-1) runs micro-batch ``i``'s forward and returns its loss
        (scaled as the caller wants, e.g. by ``1/k``); MTGS runs its backward,
        micro-batches ``0..k-2`` under ``DDP.no_sync()``. Every micro-batch's
        health (exceptions, non-finite loss, health check) is folded into the
        vote carried by the last micro-batch's all-reduce: still zero extra
        collectives. An abort retries all ``k`` micro-batches with the same
        RNG and data state. Returns a :class:`StepResult` (``loss`` is the sum
        of the micro-batch losses); raises :class:`StepAborted` when the step
        still fails after ``max_retries`` retries (parameters are those from
        before the step), :class:`CollectiveTimeout` or :class:`StepAborted`
        when a peer is lost, ``ValueError`` for ``micro_batches < 1``.
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be >= 1 (1: no accumulation)")
        step = self.committed_steps + 1
        start_ns = time.perf_counter_ns()
        rng = RngState.capture()
        data = copy.deepcopy(self.data_state.state_dict()) if self.data_state else None
        if self.shadow is not None:
            self._shadow_span = self._trace_start("shadow")
            self.shadow.begin()
        aborts: list[AbortRecord] = []
        changes: list[MembershipChange] = []
        # The last abort's codes, never the exception: its traceback holds this frame,
        # and that cycle would pin self (so the DDP reducer and its process group) until
        # the cyclic GC, after destroy_process_group() and possibly during interpreter
        # shutdown, where a Gloo worker that frees a work aborts the process.
        last_codes: dict[int, int] | None = None
        data_after: dict[str, Any] | None = None
        self._local_error = None
        attempt = 0
        while len(aborts) <= self.config.max_retries:
            try:
                loss = self._attempt(closure, step, attempt, micro_batches)
            except _AbortedError as abort:
                last_codes = abort.codes
                data_after = self.data_state.state_dict() if self.data_state else None
                aborts.append(self._recover(abort, step, attempt, rng, data))
                attempt += 1
                continue
            except _MembershipChanged as change:
                record = self._change_membership(change, step, attempt, len(changes), rng, data)
                changes.append(record)
                attempt += 1
                if record.outcome != "finalised":
                    continue
                loss = self._last_loss  # another survivor confirmed this attempt's update
            self.committed_steps = step
            return self._result(
                step,
                committed=True,
                attempts=attempt + 1,
                aborts=aborts,
                loss=loss,
                start_ns=start_ns,
                changes=changes,
            )
        assert last_codes is not None
        if self.config.on_exhausted is ExhaustedPolicy.SKIP:
            if self.data_state is not None and data_after is not None:
                self.data_state.load_state_dict(data_after)  # move past the bad batch
            self.committed_steps = step
            self._log("mtgs.skip", step=step, reasons=describe(last_codes))
            return self._result(
                step,
                committed=False,
                attempts=attempt,
                aborts=aborts,
                loss=None,
                start_ns=start_ns,
                changes=changes,
            )
        raise StepAborted(
            f"step {step} aborted on every rank after {len(aborts)} attempt(s) "
            f"(max_retries={self.config.max_retries}): {describe(last_codes)}; "
            f"parameters and optimizer state are those from before step {step}"
            + (f"; this rank's last error: {self._local_error}" if self._local_error else ""),
            step=step,
            reasons={r: reason_names(c) for r, c in last_codes.items()},
        )

    @property
    def collectives(self) -> dict[str, int]:
        """Collectives so far, by kind (the names say what each counts).

        ``bucket_allreduces``: gradient buckets the comm hook all-reduced;
        ``votes_in_buckets``: votes carried inside a last bucket (no collective of
        their own); ``explicit_votes``: vote all-reduces of the hook-less mode;
        ``commit_confirmations``: two-phase-commit confirmation all-reduces;
        ``fallback_allreduces``: zero buckets a failed rank sent for its peers.
        """
        return {
            "bucket_allreduces": self.hook.bucket_allreduces,
            "votes_in_buckets": self.hook.votes_carried,
            "explicit_votes": self.counters.explicit_votes,
            "commit_confirmations": self.counters.commit_confirmations,
            "fallback_allreduces": self.counters.fallback_allreduces,
        }

    def close(self) -> None:
        """Remove MTGS's forward hooks and stop the shadow worker (the comm hook stays)."""
        self.probe.remove()
        if self.shadow is not None:
            self.shadow.close()

    # -- one attempt -----------------------------------------------------------

    def _attempt(
        self,
        closure: Callable[..., torch.Tensor],
        step: int,
        attempt: int,
        micro_batches: int,
    ) -> torch.Tensor:
        """Forward(s), backward(s), vote, commit; returns the loss or raises ``_AbortedError``."""
        self.probe.reset()
        self.hook.begin()
        self._grad_marks = None
        sync = self._trace_start("sync")
        self._current_attempt = attempt
        self._applied = False
        code = 0
        if attempt == 0 and step in self.config.force_abort_steps:
            code |= AbortReason.FORCED
        losses: list[torch.Tensor] = []
        failed = False
        try:
            if self.faults is not None:
                self.faults.at_attempt(step, attempt)
                if self.faults.forced_abort():
                    code |= AbortReason.FORCED
        except Exception as exc:
            self._raise_if_comm(exc, step, "forward pass")
            code |= health.exception_code(exc, AbortReason.FORWARD_EXCEPTION)
            failed = True
            self._log_local(exc, step, attempt, "forward")
        for k in range(micro_batches if not failed else 0):
            last = k == micro_batches - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                code, failed = self._micro_batch(closure, step, attempt, k, micro_batches, code)
            if failed:
                break
            losses.append(self._last_loss)

        late = 0
        if failed:
            if self.hook.vote_cast:
                # The last bucket (and this rank's vote) left before the exception:
                # the vote cannot be changed, so the commit phase reports it.
                late = AbortReason.LATE_FAILURE | code
            else:
                self.hook.mark(code)
                try:
                    n = fallback.complete_collectives(
                        self.model,
                        self.probe,
                        self.hook.buckets_launched if self._hook_registered else None,
                        forwards=micro_batches,
                        grad_marks=self._grad_marks,
                    )
                except Exception as exc:
                    self._raise_if_comm(exc, step, "completion of a failed rank's all-reduces")
                    raise
                self.counters.fallback_allreduces += n

        self._trace_end(sync, step, attempt)
        vote = self._trace_start("vote")
        codes = self._vote(code, step)
        self._trace_end(vote, step, attempt, abort=bool(codes))
        if codes:
            raise _AbortedError("vote", codes, time.perf_counter_ns())
        # every rank healthy implies this rank ran every micro-batch
        assert len(losses) == micro_batches
        commit = self._trace_start("commit")
        try:
            self._commit(step, late)
        finally:
            self._trace_end(commit, step, attempt)
        total = (
            losses[0] if micro_batches == 1 else torch.stack([x.reshape(()) for x in losses]).sum()
        )
        return total.detach()

    def _micro_batch(
        self,
        closure: Callable[..., torch.Tensor],
        step: int,
        attempt: int,
        k: int,
        micro_batches: int,
        code: int,
    ) -> tuple[int, bool]:
        """Forward and backward of micro-batch ``k``; returns ``(code, failed)``."""
        last = k == micro_batches - 1
        try:
            value = closure() if micro_batches == 1 else closure(k)
            loss = _as_loss(value, self.probe.calls - k, micro_batches)
        except Exception as exc:
            self._raise_if_comm(exc, step, "forward pass")
            self._log_local(exc, step, attempt, "forward")
            return code | health.exception_code(exc, AbortReason.FORWARD_EXCEPTION), True
        try:
            code |= self._check_loss(loss)
        except Exception as exc:  # a broken predicate is an unhealthy vote, not a hang
            code |= AbortReason.HEALTH_CHECK
            self._log_local(exc, step, attempt, "health check")
        if last:
            code |= self._memory_code(step, attempt)
            if not self._hook_registered:
                # No hook counts the buckets: the fallback derives them from the gradients.
                self._grad_marks = fallback.grad_marks(self.model)
            # Before the synchronised backward: its last bucket carries the vote.
            self.hook.mark(code)
        try:
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        except Exception as exc:
            self._raise_if_comm(exc, step, "backward pass (gradient all-reduce)")
            self._log_local(exc, step, attempt, "backward")
            return code | health.exception_code(exc, AbortReason.BACKWARD_EXCEPTION), True
        self._last_loss = loss.detach()
        return code, False

    def _check_loss(self, loss: torch.Tensor) -> int:
        code = 0
        verdict = self.health_check(loss) if self.health_check is not None else True
        if isinstance(verdict, torch.Tensor):
            if self.config.vote_in_hook:
                self.hook.watch_health(verdict)
            elif not bool(verdict):
                code |= AbortReason.HEALTH_CHECK
        elif not verdict:
            code |= AbortReason.HEALTH_CHECK
        if self.config.vote_in_hook:
            self.hook.watch_loss(loss)
        elif not bool(torch.isfinite(loss.detach())):
            code |= AbortReason.NONFINITE_LOSS
        return code

    def _vote(self, code: int, step: int) -> dict[int, int]:
        if self.config.vote_in_hook:
            reduced = self.hook.reduced_codes()
            if reduced is None and self.hook.failure is not None:
                self._raise_if_comm(self.hook.failure, step, "backward pass (gradient all-reduce)")
            if reduced is None:
                raise ResiliencyError(
                    f"step {step}: the MTGS comm hook carried no vote; the backward pass must run "
                    "with gradient synchronisation (not inside DDP.no_sync()) and the hook must be "
                    "registered with this MTGS's hook state"
                )
            codes = (
                live_codes(reduced, self.reducer)
                if self.reducer is not None and self._live
                else decode_codes(reduced)
            )
        else:
            if code == 0 and not health.all_finite(
                [p.grad for p in self._params if p.grad is not None]
            ):
                # Hook-less ablation: non-finite gradients are only seen after the
                # reduction, on every rank alike, so every rank reports them.
                code |= AbortReason.NONFINITE_GRAD
            codes = self._exchange(code, step, "explicit vote all-reduce")
            self.counters.explicit_votes += 1
        if self.scaler is not None:
            # The grad scaler owns overflow: it skips the update and lowers the scale.
            codes = {r: c & ~AbortReason.NONFINITE_GRAD for r, c in codes.items()}
            codes = {r: c for r, c in codes.items() if c}
        return codes

    def _commit(self, step: int, late: int) -> None:
        code = late
        if self.shadow is not None:
            try:
                self.shadow.wait()
                if self._shadow_span is not None:
                    self._trace_end(self._shadow_span, step, self._current_attempt)
                    self._shadow_span = None
            except CaptureError as exc:
                # No rollback point: this rank must not update; it votes abort instead.
                self._log_local(exc, step, self._current_attempt, "shadow copy")
                code |= AbortReason.STEP_EXCEPTION
        if code == 0:
            code = self._apply_update(step)
        if self.config.two_phase_commit:
            try:
                codes = self._exchange(code, step, "commit confirmation all-reduce")
                self.counters.commit_confirmations += 1
            except _MembershipChanged:
                # Live mode: keep the update and the shadow until the next epoch's record
                # says whether another survivor confirmed the step (design §4.2/§4.3).
                raise
            except (StepAborted, CollectiveTimeout):
                if self.shadow is not None and self._applied:
                    self.shadow.restore()  # survivors keep no partial update
                raise
            if codes:
                raise _AbortedError("commit", codes, time.perf_counter_ns())
        elif code:
            self._repair_locally(step, code)
        self._zero_grad()

    def _apply_update(self, step: int) -> int:
        self._applied = True  # from here on the state may be (partially) modified
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        except Exception as exc:
            self._raise_if_comm(exc, step, "optimizer step")
            self._log_local(exc, step, self._current_attempt, "optimizer.step")
            return health.exception_code(exc, AbortReason.STEP_EXCEPTION)
        if self.config.check_params_finite and not health.all_finite(self._params):
            return int(AbortReason.NONFINITE_PARAMS)
        return 0

    def _repair_locally(self, step: int, code: int) -> None:
        """Without 2PC: restore this rank's shadow and redo the update on the same gradients."""
        if self.shadow is None or code & AbortReason.LATE_FAILURE:
            raise StepAborted(
                f"step {step}: the update failed on rank {self.rank} "
                f"({'+'.join(reason_names(code))}) after every rank voted to commit; without "
                "two_phase_commit and a shadow this rank cannot repair it and the other ranks "
                "have applied the step; restart the job from the last checkpoint",
                step=step,
                reasons={self.rank: reason_names(code)},
            )
        for _ in range(self.config.max_retries):
            detected = time.perf_counter_ns()
            span = self._trace_start("rollback")
            self.shadow.restore(buffers=False)  # the forward is not redone: keep its buffers
            self._trace_end(span, step, self._current_attempt, local_repair=True)
            self.ettr.record(
                "rollback",
                step=step,
                attempt=self._current_attempt,
                detected_ns=detected,
                reasons=describe({self.rank: code}),
                restored_bytes=self.shadow.nbytes,
            )
            self.local_repairs += 1
            code = self._apply_update(step)
            if code == 0:
                return
        self.shadow.restore()
        raise StepAborted(
            f"step {step}: the update kept failing on rank {self.rank} "
            f"({'+'.join(reason_names(code))}) after {self.config.max_retries} local repair(s); "
            "this rank holds the state from before the step but the other ranks applied it; "
            "restart the job from the last checkpoint",
            step=step,
            reasons={self.rank: reason_names(code)},
        )

    # -- recovery --------------------------------------------------------------

    def _recover(
        self,
        abort: _AbortedError,
        step: int,
        attempt: int,
        rng: RngState,
        data: dict[str, Any] | None,
    ) -> AbortRecord:
        """Discard the attempt on this rank; every rank runs this with the same codes."""
        span = self._trace_start("rollback" if abort.phase == "commit" else "abort")
        self._zero_grad()
        # Every rank resets, whatever the reason: a rank whose backward stopped half-way
        # needs it, and the reset must be symmetric (it schedules one bucket rebuild).
        fallback.reset_reducer(self.model)
        restored = 0
        if abort.phase == "commit" and self._applied:
            if self.shadow is None:
                raise StepAborted(
                    f"step {step}: the update failed ({describe(abort.codes)}) and there is no "
                    "shadow to roll back (MTGSConfig(shadow=False)); the update may be partially "
                    "applied; restart the job from the last checkpoint",
                    step=step,
                    reasons={r: reason_names(c) for r, c in abort.codes.items()},
                )
            self.shadow.restore()
            restored = self.shadow.nbytes
        elif self.shadow is not None:
            self.shadow.restore_buffers()  # the attempt's forward changed them in place
        rng.restore()
        if self.data_state is not None and data is not None:
            self.data_state.load_state_dict(copy.deepcopy(data))
        if (
            any(
                c & (AbortReason.OUT_OF_MEMORY | AbortReason.LOW_MEMORY)
                for c in abort.codes.values()
            )
            and torch.cuda.is_available()
        ):
            torch.cuda.empty_cache()
        kind = "rollback" if abort.phase == "commit" else "abort"
        text = describe(abort.codes)
        event = self.ettr.record(
            kind,
            step=step,
            attempt=attempt,
            detected_ns=abort.detected_ns,
            reasons=text,
            restored_bytes=restored,
        )
        self._log(
            f"mtgs.{kind}", step=step, attempt=attempt, reasons=text, ettr_ns=event.duration_ns
        )
        self._trace_end(span, step, attempt, reasons=text)
        return AbortRecord(
            attempt=attempt,
            phase=abort.phase,
            reasons={r: reason_names(c) for r, c in sorted(abort.codes.items())},
            ettr_ns=event.duration_ns,
        )

    def _change_membership(
        self,
        change: _MembershipChanged,
        step: int,
        attempt: int,
        earlier: int,
        rng: RngState,
        data: dict[str, Any] | None,
    ) -> MembershipChange:
        """Live mode: report, reform under the next epoch, then finalise or roll back the step.

        Every survivor runs it (design §4.2). ``resume_step`` of the new epoch decides: equal
        to ``step``, another survivor confirmed this step, so this rank keeps its update
        (``"finalised"``); equal to ``step - 1``, the step is redone, from the shadow if this
        rank had applied it (``"restored"``) or from the unchanged state (``"redo"``).
        """
        assert self.reducer is not None
        applied = step if self._applied else None
        self._zero_grad()
        fallback.reset_reducer(self.model)  # symmetric on every survivor
        if earlier >= self.max_membership_changes:
            if applied is not None and self.shadow is not None:
                self.shadow.restore()
            raise StepAborted(
                f"step {step}: {earlier + 1} membership changes in one step "
                f"(max_membership_changes={self.max_membership_changes}); the last one: the "
                f"{change.operation} failed ({change.cause}); this rank keeps the state from "
                f"before step {step}; raise max_membership_changes or check the replicas",
                step=step,
            )
        report = LossReport(
            committed=self.committed_steps,
            applied=applied,
            shadow_of=step if self.shadow is not None else None,
            in_flight=step,
        )
        old_epoch = self.reducer.epoch
        reform_start = time.perf_counter_ns()
        reformed = self.reducer.reform(report)
        reform_ns = time.perf_counter_ns() - reform_start
        restored = 0
        if reformed.resume_step == step and applied == step:
            outcome = "finalised"
        elif reformed.resume_step == step - 1:
            if applied is not None:
                assert self.shadow is not None  # live mode requires the shadow
                self.shadow.restore()
                restored = self.shadow.nbytes
                outcome = "restored"
            else:
                if self.shadow is not None:
                    self.shadow.restore_buffers()
                outcome = "redo"
            rng.restore()
            if self.data_state is not None and data is not None:
                self.data_state.load_state_dict(copy.deepcopy(data))
        else:
            raise ResiliencyError(
                f"step {step}: epoch {reformed.epoch} resumes after step {reformed.resume_step}, "
                f"but this rank committed step {self.committed_steps} and "
                + (f"applied step {applied}" if applied is not None else "applied nothing")
                + "; the coordinator's record contradicts this rank's state (a bug), stopping"
            )
        self.membership_changes += 1
        event = self.ettr.record(
            "membership",
            step=step,
            attempt=attempt,
            detected_ns=change.detected_ns,
            reasons=change.cause,
            restored_bytes=restored,
        )
        self._log(
            "mtgs.membership_change",
            step=step,
            attempt=attempt,
            epoch=reformed.epoch,
            members=list(reformed.members),
            resume_step=reformed.resume_step,
            outcome=outcome,
            ettr_ns=event.duration_ns,
        )
        return MembershipChange(
            attempt=attempt,
            operation=change.operation,
            cause=change.cause,
            old_epoch=old_epoch,
            epoch=reformed.epoch,
            members=reformed.members,
            resume_step=reformed.resume_step,
            outcome=outcome,
            reform_ns=reform_ns,
            ettr_ns=event.duration_ns,
        )

    def _zero_grad(self) -> None:
        for p in self.model.module.parameters():
            p.grad = None

    # -- helpers ---------------------------------------------------------------

    def _register_hook(self, hook_state: MTGSState | None) -> MTGSState:
        carry = self.config.vote_in_hook
        if hook_state is not None:
            if hook_state.carry_vote != carry:
                raise ConfigError(
                    f"hook_state.carry_vote={hook_state.carry_vote} contradicts "
                    f"MTGSConfig.vote_in_hook={carry}; create MTGSState(carry_vote={carry})"
                )
            if self.reducer is not None and hook_state.reducer is not self.reducer:
                raise ConfigError(
                    "hook_state reduces through another reducer than MTGS(reducer=...); "
                    "create MTGSState(reducer=the same reducer)"
                )
            return hook_state
        state = MTGSState(self.group, carry_vote=carry, reducer=self.reducer)
        if not carry:
            if state.live:
                raise ConfigError(
                    "live membership reduces the gradients through the MTGS comm hook; "
                    "MTGSConfig(vote_in_hook=False) registers none: keep vote_in_hook=True"
                )
            return state  # counts nothing: DDP's all-reduce (or the user's hook) reduces
        try:
            self.model.register_comm_hook(state, mtgs_comm_hook)
        except RuntimeError as exc:
            raise ConfigError(
                "MTGS could not register its comm hook because the DDP model already has one; "
                "register mtgs_comm_hook yourself and pass its state as MTGS(hook_state=...)"
            ) from exc
        return state

    def _exchange(self, code: int, step: int, operation: str) -> dict[int, int]:
        try:
            if self.reducer is not None and self._live:
                return exchange_live(code, self.reducer, self._device)
            return exchange_codes(
                code,
                group=self.group,
                device=self._device,
                timeout_s=self.config.collective_timeout_s,
            )
        except Exception as exc:
            self._raise_if_comm(exc, step, operation)
            raise

    def _raise_if_comm(self, exc: BaseException, step: int, operation: str) -> None:
        """Turn a failed collective into the error that ends this process.

        In live mode it is a membership change instead (``_MembershipChanged``): this
        attempt's epoch lost a replica, the step is redone under the next one.
        """
        if self._live and (
            isinstance(exc, MembershipLoss)
            or isinstance(self.hook.failure, MembershipLoss)
            or health.is_communication_error(exc)
        ):
            cause = self.hook.failure if self.hook.failure is not None else exc
            error = str(cause)[:500]
            self._log("mtgs.membership_loss", step=step, operation=operation, error=error)
            raise _MembershipChanged(operation, _first_line(cause), time.perf_counter_ns()) from exc
        if not health.is_communication_error(exc):
            return
        self._zero_grad()
        peers = [r for r in range(self.world_size) if r != self.rank]
        what = "timed out (a peer hung or is stopped)" if health.is_timeout(exc) else "lost a peer"
        # With the commit confirmation no survivor can have kept the update (one that
        # applied it restores its shadow when the confirmation fails); without it a
        # peer may have applied it before the failure reached it.
        applied = (
            f"no surviving rank applied step {step}"
            if self.config.two_phase_commit and self.shadow is not None
            else f"this rank did not apply step {step}"
        )
        message = (
            f"rank {self.rank}: step {step} aborted: the {operation} {what}; peers in this "
            f"collective: ranks {peers}; {applied} (this rank keeps the state from before it); "
            f"the process group is unusable, restart the job (GEMINI recovers the last "
            f"checkpoint). Cause: {_first_line(exc)}"
        )
        self._log("mtgs.collective_failure", step=step, operation=operation, error=str(exc)[:500])
        if health.is_timeout(exc):
            raise CollectiveTimeout(message) from exc
        raise StepAborted(message, step=step) from exc

    def _result(
        self,
        step: int,
        *,
        committed: bool,
        attempts: int,
        aborts: list[AbortRecord],
        loss: torch.Tensor | None,
        start_ns: int,
        changes: list[MembershipChange] | None = None,
    ) -> StepResult:
        if aborts or changes:
            self._log("mtgs.commit" if committed else "mtgs.skipped", step=step, attempts=attempts)
        return StepResult(
            step=step,
            committed=committed,
            attempts=attempts,
            aborts=tuple(aborts),
            loss=loss,
            recovery_ns=sum(a.ettr_ns for a in aborts),
            step_ns=time.perf_counter_ns() - start_ns,
            membership_changes=tuple(changes or ()),
        )

    def _memory_code(self, step: int, attempt: int) -> int:
        """``LOW_MEMORY`` when this rank's headroom is below ``min_memory_headroom``, else 0."""
        if self.config.min_memory_headroom <= 0:
            return 0
        room = memory_health.headroom(self._device, limit_bytes=self.config.memory_limit_bytes)
        if room is None or room.fraction >= self.config.min_memory_headroom:
            return 0
        self._log(
            "mtgs.low_memory",
            step=step,
            attempt=attempt,
            headroom=room.describe(),
            min_headroom=self.config.min_memory_headroom,
        )
        return int(AbortReason.LOW_MEMORY)

    def _trace_start(self, phase: str) -> Span | None:
        return self.tracer.start(phase) if self.tracer is not None else None

    def _trace_end(self, span: Span | None, step: int, attempt: int, **args: Any) -> None:
        if span is not None and self.tracer is not None:
            self.tracer.end(span, step=step, attempt=attempt, **args)

    def _log(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.log(event, **fields)

    def _log_local(self, exc: BaseException, step: int, attempt: int, where: str) -> None:
        self._local_error = f"{type(exc).__name__} in {where}: {exc}"[:500]
        self._log(
            "mtgs.local_failure",
            step=step,
            attempt=attempt,
            where=where,
            error=f"{type(exc).__name__}: {exc}"[:500],
        )


def _membership_budget(reducer: Reducer | None, given: int | None, config: MTGSConfig) -> int:
    if reducer is None or not reducer.live:
        if given is not None:
            raise ConfigError(
                f"max_membership_changes={given} needs a live reducer (MTGS(reducer=...)); "
                "without live membership a lost peer ends the job"
            )
        return 0
    if not (config.two_phase_commit and config.shadow):
        raise ConfigError(
            f"live membership needs MTGSConfig(two_phase_commit=True, shadow=True), got "
            f"two_phase_commit={config.two_phase_commit}, shadow={config.shadow}: a survivor "
            "that applied the lost step must be able to roll it back until the next epoch "
            "says whether any survivor confirmed it"
        )
    budget = reducer.slots if given is None else given
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(
            f"max_membership_changes={given!r} must be an int >= 0 (membership changes one "
            "step may go through), e.g. the replica count"
        )
    return budget


def _as_loss(value: object, model_calls: int, micro_batches: int) -> torch.Tensor:
    if model_calls != 1:
        per = "micro-batch" if micro_batches > 1 else "step"
        raise ResiliencyError(
            f"the step closure called the DDP model {model_calls} times; it must call it exactly "
            f"once per {per} (for gradient accumulation pass micro_batches=k and let "
            "closure(i) run micro-batch i)"
        )
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ResiliencyError(
            "the step closure must return the loss as a one-element tensor, "
            f"got {type(value).__name__}"
        )
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The fault injector: makes scheduled faults happen inside a real training step.

Safety guard: an injector with a non-empty schedule only acts in a process that
opted in, either with the environment variable ``LM_RESILIENCY_FAULTS=1`` or
an explicit :meth:`FaultInjector.arm` call. :meth:`FaultInjector.install`
refuses (``ConfigError``) otherwise, so a schedule left in a production
configuration cannot kill a job. ``dry_run=True`` installs everything but only
logs what it would have done.

Call order::

    injector = FaultInjector(schedule, rank=rank)
    injector.arm()                       # or LM_RESILIENCY_FAULTS=1
    injector.install(model, optimizer)   # the unwrapped module (not the DDP wrapper)
    # every attempt of every step (MTGS does this when given faults=injector):
    injector.at_attempt(step, attempt)   # may raise DATA_EXCEPTION
    injector.forced_abort()              # True if FORCED_ABORT hits now

Where each kind acts is documented on :class:`FaultKind`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults.schedule import Fault, FaultKind, FaultSchedule
from lm_resiliency.telemetry import EventLog

ARM_ENV = "LM_RESILIENCY_FAULTS"


class InjectedFaultError(RuntimeError):
    """The exception an injected fault raises (a ``RuntimeError``, like most torch errors)."""


@dataclass(frozen=True)
class FiredFault:
    """A fault that fired (or would have, in dry-run mode)."""

    fault: Fault
    step: int
    attempt: int
    dry_run: bool


class FaultInjector:
    """Per-rank fault injection for MTGS tests, demos and benchmarks; see the module doc."""

    def __init__(
        self,
        schedule: FaultSchedule | str | None,
        *,
        rank: int,
        dry_run: bool = False,
        events: EventLog | None = None,
        sigstop_resume_s: float | None = None,
    ) -> None:
        if isinstance(schedule, str) or schedule is None:
            schedule = FaultSchedule.parse(schedule)
        self.schedule = schedule.for_rank(rank)
        self.job_schedule = schedule
        """The whole schedule, every rank's items: live membership's members read the
        ``join@R:S`` items of other replicas from it (they wait for R's admission)."""
        self.rank = rank
        self.dry_run = dry_run
        self.events = events
        self.sigstop_resume_s = sigstop_resume_s
        self.fired: list[FiredFault] = []
        self.step = 0
        self.attempt = 0
        self._armed = False
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []

    @property
    def armed(self) -> bool:
        """Whether this process opted in (``arm()`` or ``LM_RESILIENCY_FAULTS=1``)."""
        return self._armed or os.environ.get(ARM_ENV) == "1"

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` attached the hooks (and :meth:`remove` did not detach them)."""
        return bool(self._handles)

    def arm(self) -> None:
        """Opt this process in to real fault injection."""
        self._armed = True

    def install(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Attach the hooks that inject this rank's faults into ``model`` and ``optimizer``.

        Raises ``ConfigError`` if the schedule is not empty, the process is not
        armed and ``dry_run`` is off.
        """
        if len(self.schedule) and not self.armed and not self.dry_run:
            raise ConfigError(
                f"refusing to inject faults ({self.schedule.spec()}) into a process that did not "
                f"opt in: set {ARM_ENV}=1 or call FaultInjector.arm(), or use dry_run=True"
            )
        params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("fault injection needs a model with trainable parameters")
        self._params = params
        self._handles.append(model.register_forward_pre_hook(self._on_forward))
        self._handles.append(params[0].register_hook(self._on_first_grad))  # type: ignore[no-untyped-call]
        self._handles.append(params[len(params) // 2].register_hook(self._on_middle_grad))  # type: ignore[no-untyped-call]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def at_attempt(self, step: int, attempt: int) -> None:
        """Start ``attempt`` (0-based) of ``step`` (1-based); raises a scheduled DATA_EXCEPTION."""
        self.step = step
        self.attempt = attempt
        if self._fire(FaultKind.DATA_EXCEPTION):
            raise InjectedFaultError(self._what("data_exception"))

    def forced_abort(self) -> bool:
        """Whether a FORCED_ABORT fault hits the current attempt."""
        return self._fire(FaultKind.FORCED_ABORT)

    # -- hooks -------------------------------------------------------------------

    def _on_forward(self, module: Any, args: Any) -> None:
        if self._fire(FaultKind.OOM):
            raise torch.OutOfMemoryError(self._what("oom (injected out of memory)"))
        if self._fire(FaultKind.FORWARD_EXCEPTION):
            raise InjectedFaultError(self._what("forward_exception"))

    def _on_first_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self._fire(FaultKind.SIGKILL):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fire(FaultKind.SIGSTOP):
            self._stop()
        if self._fire(FaultKind.NAN_GRAD):
            return grad * float("nan")
        return None

    def _on_middle_grad(self, grad: torch.Tensor) -> None:
        if self._fire(FaultKind.BACKWARD_EXCEPTION):
            raise InjectedFaultError(self._what("backward_exception"))

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._fire(FaultKind.OPTIMIZER_EXCEPTION):
            with torch.no_grad():
                for p in self._params[len(self._params) // 2 :]:
                    p.fill_(float("nan"))
            raise InjectedFaultError(self._what("optimizer_exception after a partial update"))

    # -- internals ---------------------------------------------------------------

    def _fire(self, kind: FaultKind) -> bool:
        hits = self.schedule.hitting([kind], self.rank, self.step, self.attempt)
        # A one-shot fault fires once, even if the step re-enters the same point
        # without a new attempt (e.g. a local repair of optimizer.step()).
        hits = [f for f in hits if f.persistent or all(x.fault != f for x in self.fired)]
        if not hits:
            return False
        fired = FiredFault(hits[0], self.step, self.attempt, self.dry_run)
        self.fired.append(fired)
        if self.events is not None:
            self.events.log(
                "fault.dry_run" if self.dry_run else "fault.inject",
                kind=kind.value,
                step=self.step,
                attempt=self.attempt,
            )
        if not self.dry_run and not self.armed:
            raise ConfigError(f"fault {kind.value} reached an unarmed process; set {ARM_ENV}=1")
        return not self.dry_run

    def _what(self, kind: str) -> str:
        return f"injected {kind} on rank {self.rank} at step {self.step} attempt {self.attempt}"

    def _stop(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.sigstop_resume_s is not None:
            # A detached helper sends SIGCONT later: the hang ends and the process
            # finds its peers gone, like a node that froze and came back.
            subprocess.Popen(
                ["/bin/sh", "-c", f"sleep {self.sigstop_resume_s}; kill -CONT {os.getpid()}"],
                start_new_session=True,
            )
        os.kill(os.getpid(), signal.SIGSTOP)

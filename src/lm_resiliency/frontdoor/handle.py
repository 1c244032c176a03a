"""ResiliencyHandle: what ``enable_resiliency`` returns; the training loop barely touches it.

From construction on, the handle hangs off the step boundary of the adapter
(the optimizer's step hooks for PyTorch models): before each step it waits for
the capture in flight, after each step it counts and captures every
``interval`` steps. With MTGS, :meth:`train_step` runs each step as a
transaction and captures only committed steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.errors import ConfigError, ResiliencyError
from lm_resiliency.frontdoor.boundary import BlockingStats, CaptureBoundary, CaptureGate
from lm_resiliency.frontdoor.live_exit import exit_on_membership_loss
from lm_resiliency.frontdoor.resume import RecoveryInfo
from lm_resiliency.integrations.base import Adapter, Unbind

if TYPE_CHECKING:
    from lm_resiliency.detection import Scout, ScoutResult
    from lm_resiliency.frontdoor.live import LiveSession, LiveStatus
    from lm_resiliency.live.sampler import GlobalBatchSampler
    from lm_resiliency.transactions import MTGS, StepResult

__all__ = ["ResiliencyHandle"]

log = logging.getLogger(__name__)


class ResiliencyHandle:
    """One rank's view of the resiliency tiers; built by :func:`enable_resiliency` only.

    Attributes: ``start_step`` (0 for a fresh job, N after recovering step N:
    train from ``start_step + 1``), ``last_recovery`` (:class:`RecoveryInfo`),
    ``manager`` (the GEMINI manager, for advanced use), ``adapter`` (the
    framework adapter), ``mtgs`` (the step transaction when ``mtgs=`` was given),
    ``scout`` (SCOUT when ``scout=`` was given; ``last_scout`` its latest result).
    """

    def __init__(
        self,
        *,
        manager: InMemoryCheckpointManager,
        adapter: Adapter,
        boundary: CaptureBoundary,
        unbind: Unbind,
        recovery: RecoveryInfo,
        mtgs: MTGS | None,
        scout: Scout | None = None,
        live: LiveSession | None = None,
    ) -> None:
        self.manager = manager
        self.live = live
        self.adapter = adapter
        self.mtgs = mtgs
        self.scout = scout
        self.last_recovery = recovery
        self.start_step = recovery.step or 0
        self._boundary = boundary
        self._unbind: Unbind | None = unbind
        self._closed = False

    @property
    def step(self) -> int:
        """Completed training steps (``start_step`` plus the steps taken since enable)."""
        return self._boundary.step

    @property
    def last_scout(self) -> ScoutResult | None:
        """The latest resolved SCOUT check (``None`` without ``scout=`` or before the first).

        Pipelined (the default), every check resolves at the next step's pre-step hook:
        after ``optimizer.step()`` of step t this is the newest check before t, so a loop
        reading it after every step sees every verdict, one step late (docs/scout.md).
        """
        return self.scout.last_result if self.scout is not None else None

    @property
    def membership(self) -> LiveStatus:
        """Live membership now: epoch, members, this replica's index and weight, the last
        change with its reason and timings (needs ``live=LiveConfig(...)``)."""
        return self._live("handle.membership").status()

    def sampler(
        self, global_batch: int, dataset_len: int, seed: int = 0, *, steps: int | None = None
    ) -> GlobalBatchSampler:
        """The ``batch_sampler`` of this replica's share of each step's global batch.

        ``DataLoader(dataset, batch_sampler=handle.sampler(B, len(dataset), seed),
        num_workers=0)``; draw the batch inside the step closure (``next(it)``), so a step
        redone under a new membership re-splits the same ``B`` samples. ``steps`` ends the
        iteration after that step. Needs ``live=LiveConfig(...)``; call it once.
        """
        return self._live("handle.sampler(...)").sampler(
            global_batch, dataset_len, seed, steps=steps
        )

    def batch_indices(self, step: int) -> list[int]:
        """This replica's sample ids of ``step`` under the current membership (for a loader of
        your own; after :meth:`sampler`)."""
        return self._live("handle.batch_indices(step)").batch_indices(step)

    def _live(self, what: str) -> LiveSession:
        self._check_open()
        if self.live is None:
            raise ConfigError(
                f"{what} needs live membership: pass live=LiveConfig(...) (with "
                "mtgs=MTGSConfig()) to enable_resiliency and run under lm-resiliency launch"
            )
        return self.live

    @property
    def interval(self) -> int:
        """Capture cadence in steps."""
        return self.manager.config.interval

    @property
    def stats(self) -> BlockingStats:
        """Blocking time per capture seen by the training loop through the hooks."""
        return self._boundary.stats

    def add_capture_gate(self, gate: CaptureGate) -> None:
        """Run ``gate(step)`` at every capture boundary before the capture; ``False`` skips it.

        The hook point for SCOUT: it runs on every rank at the same step, after
        the step and before its capture, and must give the same answer on every
        rank. Gates run in the order they were added.
        """
        self._check_open()
        self._boundary.gates.append(gate)

    def train_step(
        self,
        closure: Callable[..., torch.Tensor],
        *,
        micro_batches: int = 1,
    ) -> StepResult:
        """Run one training step as an MTGS transaction (needs ``mtgs=MTGSConfig(...)``).

        Collective: every rank calls it once per step. ``closure()`` runs the
        forward pass and returns the loss (MTGS runs backward and
        ``optimizer.step()``). With ``micro_batches=k > 1`` gradients are
        accumulated: ``closure(i)`` runs micro-batch ``i`` (0..k-1) and returns
        its loss (scale it by ``1/k`` yourself); micro-batches ``0..k-2`` run
        under ``DDP.no_sync()``, the last one's all-reduce carries every
        micro-batch's health in the vote; an abort retries all ``k`` with the
        same batches and random numbers. The capture wait happens before MTGS's
        own ``optimizer.step()``; only a committed step is counted as captured
        (an aborted attempt never is). Returns MTGS's ``StepResult``; raises
        ``StepAborted``/``CollectiveTimeout`` as :meth:`MTGS.step` does.
        """
        self._check_open()
        if self.mtgs is None:
            raise ConfigError(
                "train_step() runs a step as an MTGS transaction; pass "
                "mtgs=MTGSConfig(...) to enable_resiliency, or call loss.backward() and "
                "optimizer.step() yourself (the capture then hangs off optimizer.step())"
            )
        if self.live is None:
            return self._after(self.mtgs.step(closure, micro_batches=micro_batches))
        with self._exits_on_membership_loss():  # evicted: 76; coordinator lost: 75
            self.live.membership.check()  # the step boundary (docs/live-membership.md §2.5)
            self.live.before_step(self.close)
            closure = self.live.wrap(closure)
            result = self.mtgs.step(closure, micro_batches=micro_batches)
            self.live.after_step(result)
        return self._after(result)

    def _after(self, result: StepResult) -> StepResult:
        if result.committed:
            self._boundary.after_step()
        else:
            self._boundary.count_only()
        return result

    def close(self) -> None:
        """Finish the capture in flight, remove every hook, close the manager. Idempotent.

        Collective like the manager's ``close`` (call it on every rank at the end).
        """
        if self._closed:
            return
        self._closed = True
        if self.live is not None:
            with self._exits_on_membership_loss():
                self.live.finish()  # no member leaves while another confirms the last step
        if self._unbind is not None:
            self._unbind()
            self._unbind = None
        try:
            self.adapter.close()
            if self.mtgs is not None:
                self.mtgs.close()
            if self.scout is not None:
                self.scout.close()
        finally:
            try:
                self.manager.close()
            finally:
                if self.live is not None:
                    self.live.close()

    def _exits_on_membership_loss(self) -> AbstractContextManager[None]:
        """Live mode: an ``Evicted``/``CoordinatorLost`` exits the process (76/75) after
        finishing the capture in flight and keeping the memory slots (frontdoor/live_exit.py)."""
        assert self.live is not None
        config = self.live.config
        return exit_on_membership_loss(
            replica=self.live.replica,
            cleanup=lambda: self.manager.close(finished=False),
            cleanup_timeout_s=config.coordinator_timeout_s,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ResiliencyError("this ResiliencyHandle is closed; call enable_resiliency again")

    def __enter__(self) -> ResiliencyHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""The step boundary the optimizer hooks drive: wait before the step, capture after it.

``before_step`` waits for the capture in flight (its copy must be complete
before the parameters change, or it would mix two steps); ``after_step``
counts the step and, every ``interval`` steps, asks each capture gate (SCOUT,
when enabled) whether this step may be captured, then launches the capture
and tells each ``after_capture`` hook (SCOUT certifies it); on every other
step it runs the ``between`` hooks (SCOUT classes on another cadence). The
``before`` hooks run in every ``before_step`` after the wait (SCOUT resolves a
pipelined check there, so each verdict is known after the next step).
Both are timed: the sum is the blocking time per capture the training loop sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.frontdoor.schedulers import SchedulerReplay

__all__ = ["BlockingStats", "CaptureBoundary", "CaptureGate", "WaitOnly"]

CaptureGate = Callable[[int], bool]
"""``gate(step) -> bool`` at a capture boundary, before the capture; ``False`` skips it.

Runs on every rank at the same step (it may be collective, like SCOUT's check)
and must return the same answer on every rank (a job-wide decision)."""


@dataclass
class BlockingStats:
    """Time the training loop spent blocked in the hooks, per capture."""

    captures: int = 0
    skipped: int = 0
    launch_s: list[float] = field(default_factory=list)
    """Time inside the post-step hook that launched each capture (encode + launch)."""
    wait_s: list[float] = field(default_factory=list)
    """Time inside the next pre-step hook waiting for that capture's copy."""

    def per_capture_s(self) -> list[float]:
        """Blocking time of each completed capture cycle (launch + wait)."""
        return [a + b for a, b in zip(self.launch_s, self.wait_s, strict=False)]


class CaptureBoundary:
    """Implements :class:`~lm_resiliency.integrations.base.StepBoundary` for one handle."""

    def __init__(
        self,
        manager: InMemoryCheckpointManager,
        *,
        interval: int,
        start_step: int,
        build_tree: Callable[[int, Any], Any],
        rank_part: Callable[[], Any],
        schedulers: SchedulerReplay | None = None,
    ) -> None:
        self._manager = manager
        self._schedulers = schedulers
        self._interval = interval
        self._build_tree = build_tree
        self._rank_part = rank_part
        self._settled: Any = None  # the per-rank part taken at optimizer_done, for after_step
        self.step = start_step
        self.gates: list[CaptureGate] = []
        self.after_capture: list[Callable[[int], None]] = []
        self.between: list[Callable[[int], object]] = []
        self.before: list[Callable[[], object]] = []
        self.stats = BlockingStats()
        self._in_flight = False

    def before_step(self) -> None:
        if self._schedulers is not None:
            self._schedulers.check()  # the loop stepped each scheduler once since after_step
        if self._in_flight:
            t0 = time.perf_counter()
            self._manager.maybe_wait()
            self.stats.wait_s.append(time.perf_counter() - t0)
            self._in_flight = False
        for hook in self.before:
            hook()

    def optimizer_done(self) -> None:
        """Take the per-rank part (RNGs, ``state`` objects) now, when this step is captured."""
        if (self.step + 1) % self._interval == 0:
            self._settled = self._rank_part()

    def after_step(self) -> None:
        if self._schedulers is not None:
            self._schedulers.expect_step()
        self.step += 1
        step = self.step
        settled, self._settled = self._settled, None
        if step % self._interval:
            for hook in self.between:
                hook(step)
            return
        if not all(gate(step) for gate in self.gates):
            self.stats.skipped += 1
            return
        t0 = time.perf_counter()
        self._manager.save(self._build_tree(step, settled), step)
        self.stats.launch_s.append(time.perf_counter() - t0)
        self.stats.captures += 1
        held = self._manager.trust.take_held(step)  # SCOUT's pipelined verdict: not decided
        if held is not None:
            held.on_decided(self._count_verdict)
        self._in_flight = True
        for done in self.after_capture:
            done(step)

    def _count_verdict(self, accepted: bool) -> None:
        """A held capture's verdict: a discarded one counts as skipped, not captured."""
        if not accepted:
            self.stats.captures -= 1
            self.stats.skipped += 1

    def count_only(self) -> None:
        """A step that happened but must not be captured (an MTGS step skipped on exhaustion)."""
        self.step += 1


class WaitOnly:
    """A boundary that only waits: MTGS owns the commit, so the handle counts after it."""

    def __init__(self, inner: CaptureBoundary) -> None:
        self._inner = inner

    def before_step(self) -> None:
        self._inner.before_step()

    def optimizer_done(self) -> None:
        return None

    def after_step(self) -> None:
        return None

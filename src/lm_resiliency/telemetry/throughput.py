"""Tokens per second over training steps, with warm-up steps excluded."""

from __future__ import annotations

import time


class ThroughputMeter:
    """Call :meth:`start` before the first step and :meth:`step` after each one.

    The first ``warmup_steps`` intervals are excluded from :attr:`tokens_per_s`
    (allocator warm-up, DDP's bucket rebuild). All times use ``perf_counter_ns``.
    """

    def __init__(self, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.tokens = 0
        self.elapsed_ns = 0
        self.rates: list[float] = []
        self._last: int | None = None

    def start(self) -> None:
        """Mark the beginning of the first measured interval."""
        self._last = time.perf_counter_ns()

    def step(self, tokens: int) -> float:
        """Close one interval of ``tokens`` tokens; returns its tokens/s."""
        now = time.perf_counter_ns()
        if self._last is None:
            raise RuntimeError("ThroughputMeter.step() called before start()")
        dt = max(now - self._last, 1)
        self._last = now
        self.steps += 1
        rate = tokens * 1e9 / dt
        self.rates.append(rate)
        if self.steps > self.warmup_steps:
            self.tokens += tokens
            self.elapsed_ns += dt
        return rate

    @property
    def tokens_per_s(self) -> float:
        """Mean throughput of the measured intervals (total tokens / total time); 0 if none."""
        return self.tokens * 1e9 / self.elapsed_ns if self.elapsed_ns else 0.0

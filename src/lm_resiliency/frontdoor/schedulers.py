"""LR schedulers in ``state=`` that the loop steps after the captured ``optimizer.step()``.

The plain loop is ``optimizer.step(); scheduler.step()``. The capture of step N
runs in the optimizer's post-hook, so it sees the scheduler before that step's
``scheduler.step()``. That call is deterministic given the restored scheduler
and optimizer. So a capture records each such scheduler's state together with
the call still to come: the scheduler as it will be after ``scheduler.step()``.
The restore loads the captured state and replays that one call
(:meth:`SchedulerReplay.replay`). The call also writes the learning rate into
the optimizer's param groups, exactly as the uninterrupted run did. No line
follows the restore in the user's loop.

This holds only for a loop that steps each scheduler exactly once per optimizer
step, right after it. :meth:`SchedulerReplay.check` runs at every optimizer step
and raises ``ConfigError`` for any other order. Examples: a per-epoch
scheduler, a scheduler stepped twice, or one stepped before the optimizer.
``ReduceLROnPlateau`` steps on a metric, so its call cannot be replayed; it is
refused at enable. Under MTGS the transaction steps the schedulers before the
capture, and adapters whose step ends after the framework's own scheduler step
(DeepSpeed, Megatron, the HF ``Trainer``) capture them afterwards. Neither
replays anything.

Call order, on every rank: :meth:`expect_step` at the boundary's ``after_step``
(in the optimizer's post-hook), then :meth:`check` at the next ``before_step``
(the next optimizer's pre-hook). :meth:`replay` runs in the restore, after the
optimizer and the scheduler states are loaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from lm_resiliency.errors import ConfigError

__all__ = ["SchedulerReplay"]

# torch warns when a scheduler steps before any optimizer step of this process; the
# replay is the call that followed the captured optimizer step.
_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class SchedulerReplay:
    """The torch LR schedulers among the ``state`` objects whose step follows the capture."""

    def __init__(self, objects: Iterable[tuple[str, Any]], *, active: bool) -> None:
        """``active``: the captures run before the loop's ``scheduler.step()`` (the plain
        loop without MTGS); only then is anything checked, recorded or refused."""
        self._schedulers = [(n, o) for n, o in objects if isinstance(o, LRScheduler)]
        self.active = active and bool(self._schedulers)
        for name, obj in self._schedulers if self.active else []:
            if isinstance(obj, ReduceLROnPlateau):
                raise ConfigError(
                    f"state[{name!r}] is a ReduceLROnPlateau: it steps on a metric, not once "
                    "per optimizer step, so the capture inside optimizer.step() cannot replay "
                    "its call on restore; leave it out of state= and save it with your durable "
                    "checkpoint, or use mtgs= (the transaction steps it)"
                )
        self._expected: dict[str, int] | None = None

    def to_replay(self) -> list[str]:
        """Names of the schedulers a capture taken now replays, in the order given."""
        return [n for n, _ in self._schedulers] if self.active else []

    def expect_step(self) -> None:
        """At ``after_step``: each scheduler must be stepped once before the next step."""
        if self.active:
            self._expected = {n: _epoch(o) + 1 for n, o in self._schedulers}

    def check(self) -> None:
        """At ``before_step``: raise ``ConfigError`` unless every scheduler stepped once."""
        expected, self._expected = self._expected, None
        if expected is None:
            return
        for name, obj in self._schedulers:
            found = _epoch(obj)
            if found != expected[name]:
                times = found - expected[name] + 1
                raise ConfigError(
                    f"state[{name!r}] ({type(obj).__name__}) is at last_epoch={found} at this "
                    f"optimizer step, expected {expected[name]}: it was stepped {times} times "
                    "since the previous optimizer.step(). enable_resiliency captures it inside "
                    "optimizer.step() and replays the one scheduler.step() that follows on "
                    "restore; step it exactly once right after every optimizer.step(), or "
                    "leave it out of state= and restore it yourself"
                )

    def replay(self, names: Sequence[str]) -> None:
        """The restore: the ``scheduler.step()`` that followed the captured optimizer step."""
        known = dict(self._schedulers)
        missing = [n for n in names if n not in known]
        if missing:
            raise ConfigError(
                f"the checkpoint replays LR schedulers {missing}, but state= has no LR "
                f"scheduler of that name (schedulers: {sorted(known)}); pass the same state "
                "objects as the run that wrote it"
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ORDER_WARNING)
            for name in names:
                known[name].step()


def _epoch(scheduler: LRScheduler) -> int:
    return int(scheduler.last_epoch)

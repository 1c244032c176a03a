"""Named points where a test launcher may SIGKILL this process (a leaf module, no imports).

Product code calls :func:`kill_point` at the few places where a crash is worth
testing (mid-write, mid-copy, mid-receive); it does nothing unless the process
was started by :func:`lm_resiliency.testing.run_distributed` with ``kill={rank: name}``
(or ``LM_RESILIENCY_TEST_KILL=name`` is set by a test). A point that passes its
step (``kill_point("live.vote", step=s)``) can also be selected for one step only,
with ``LM_RESILIENCY_TEST_KILL=live.vote@5``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

KILL_ENV = "LM_RESILIENCY_TEST_KILL"
KILL_STAMP_ENV = "LM_RESILIENCY_TEST_KILL_STAMP"
"""A file that :func:`kill_point` writes the wall time (``time.time()``) of the kill to, just
before the SIGKILL (the live demo and benchmark measure from it)."""

LIVE_KILL_POINTS = (
    "live.forward",
    "live.bucket_allreduce",
    "live.before_step",
    "live.vote",
    "live.confirm",
    "live.heal_send",
    "live.heal_recv",
)
"""The kill points of live membership (docs/live-membership.md §9), in step order: inside the
forward, inside the cross-replica gradient all-reduce, between the all-reduce and
``optimizer.step()``, during the commit vote and its confirmation, and on either side of a heal.
Their call sites pass ``step=``."""


def kill_point(name: str, *, step: int | None = None) -> None:
    """SIGKILL this process if it was scheduled to die at ``name`` (or ``name@step``).

    The process dies without cleanup, exactly like an OOM kill or a lost node.
    """
    target = os.environ.get(KILL_ENV)
    if target is not None and (target == name or (step is not None and target == f"{name}@{step}")):
        stamp = os.environ.get(KILL_STAMP_ENV)
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

"""Named points where a test launcher may SIGKILL this process (a leaf module, no imports).

Product code calls :func:`kill_point` at the few places where a crash is worth
testing (mid-write, mid-copy, mid-receive); it does nothing unless the process
was started by :func:`lm_resiliency.testing.run_distributed` with ``kill={rank: name}``
(or ``LM_RESILIENCY_TEST_KILL=name`` is set by a test).
"""

from __future__ import annotations

import os
import signal
import sys

KILL_ENV = "LM_RESILIENCY_TEST_KILL"


def kill_point(name: str) -> None:
    """SIGKILL this process if it was scheduled to die at ``name``.

    The process dies without cleanup, exactly like an OOM kill or a lost node.
    """
    target = os.environ.get(KILL_ENV)
    if target is not None and target == name:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

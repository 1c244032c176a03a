"""How a live-membership process leaves when it is evicted or the coordinator is lost.

docs/live-membership.md §2.5 and §3 (fencing): two errors end a live process instead of
reaching the training loop, which has no exception handling.

* :class:`~lm_resiliency.live.view.Evicted` (a newer epoch does not admit this incarnation,
  e.g. it was SIGSTOPped past its lease and woke up): one line on stderr, exit code
  :data:`EXIT_EVICTED` (76). Its torchrun restarts it; the new process registers as a joiner.
* :class:`~lm_resiliency.live.view.RunFinished` (a replica restarted after every member
  finished): one line on stderr, exit code 0.
* :class:`~lm_resiliency.live.view.CoordinatorLost` (the coordinator is silent, unreachable or
  gone, or fewer than ``min_replicas`` survived): the one line of §2.5, exit code
  :data:`EXIT_COORDINATOR_LOST` (75). Every group's torchrun restarts its workers, which
  recover from their memory under the next coordinator generation.

Before exiting, the capture in flight is finished and the memory slots are kept
(``manager.close(finished=False)``, on the caller's thread, a watchdog exits the process after
``coordinator_timeout_s``), so the restarted
process recovers the newest complete step. The exit is ``os._exit``: no Gloo destructor of a
group whose peers are gone runs (one can ``std::terminate``), and no thread blocked on a
stopped coordinator holds the process.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from lm_resiliency.live.view import CoordinatorLost, Evicted, ReplicaTaken, RunFinished

__all__ = [
    "EXIT_COORDINATOR_LOST",
    "EXIT_EVICTED",
    "exit_on_membership_loss",
    "finished_process",
    "leave_process",
]

EXIT_COORDINATOR_LOST = 75
"""Exit status of a process whose coordinator was lost (falls back to the whole-job restart)."""
EXIT_EVICTED = 76
"""Exit status of a replica evicted from the membership (restarted as a joiner), or of a process
whose claim on a replica another process took (restarted, it waits as a spare)."""


def leave_process(
    exc: Evicted | CoordinatorLost | ReplicaTaken,
    *,
    replica: int | None,
    cleanup: Callable[[], None] | None,
    cleanup_timeout_s: float,
) -> NoReturn:
    """Log the one line for ``exc``, run ``cleanup`` (bounded) and exit with its code."""
    code = EXIT_EVICTED if isinstance(exc, (Evicted, ReplicaTaken)) else EXIT_COORDINATOR_LOST
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, Evicted):
        line = (
            f"live membership: {_who(replica)} (pid {os.getpid()}) was evicted at epoch "
            f"{exc.epoch} ({exc.reason}); nothing it sends is accepted any more; exiting with "
            f"code {code} so that its torchrun restarts it as a joining replica"
        )
    elif isinstance(exc, ReplicaTaken):
        # Its claim was reopened (it was too slow) and another process holds the replica.
        line = (
            f"live membership: pid {os.getpid()}: {exc}; exiting with code {code} so that its "
            "torchrun starts it again (it waits as a spare)"
        )
    else:
        body = text.removeprefix("live membership: ")
        line = f"live membership: {_who(replica)} (pid {os.getpid()}): {body} (exit code {code})"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if cleanup is not None:
        # On this thread (the manager's close restores signal handlers: main thread only); a
        # watchdog exits the process if it does not return in time.
        watchdog = threading.Timer(
            cleanup_timeout_s, _exit_late, args=(replica, cleanup_timeout_s, code)
        )
        watchdog.daemon = True
        watchdog.start()
        _quietly(cleanup)
        watchdog.cancel()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def exit_on_membership_loss(
    *, replica: int | None, cleanup: Callable[[], None] | None, cleanup_timeout_s: float
) -> Iterator[None]:
    """Turn an ``Evicted``/``CoordinatorLost`` raised in the block into :func:`leave_process`."""
    try:
        yield
    except (Evicted, CoordinatorLost) as exc:
        leave_process(exc, replica=replica, cleanup=cleanup, cleanup_timeout_s=cleanup_timeout_s)
    except RunFinished as exc:
        finished_process(exc, replica=replica)


def finished_process(exc: RunFinished, *, replica: int | None) -> NoReturn:
    """A replica restarted after every member finished: one line on stderr, exit 0.

    Its torchrun then ends with success, like the groups that trained to the end; the
    process holds nothing to keep (it never trained in this run).
    """
    sys.stderr.write(
        f"live membership: {_who(replica)} (pid {os.getpid()}): {exc}; exiting with code 0\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _who(replica: int | None) -> str:
    """``replica N``, or ``a warm spare`` for a process that holds no replica yet."""
    return "a warm spare" if replica is None else f"replica {replica}"


def _exit_late(replica: int | None, timeout_s: float, code: int) -> None:
    sys.stderr.write(
        f"live membership: {_who(replica)}: the capture in flight did not finish within "
        f"{timeout_s:g} s; exiting without it\n"
    )
    sys.stderr.flush()
    os._exit(code)


def _quietly(cleanup: Callable[[], None]) -> None:
    try:
        cleanup()
    except BaseException as exc:  # the process exits next; say what the cleanup hit
        sys.stderr.write(f"live membership: cleanup before the exit failed: {exc!r}\n")

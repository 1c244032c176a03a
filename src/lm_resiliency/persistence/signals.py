"""Flush on SIGTERM/SIGINT within a deadline, then behave as if we were never there.

A scheduler's SIGTERM (or a user's Ctrl-C) gives a grace period before the
hard kill. :func:`install_flush_on_signal` uses it: on the first signal it runs
the given flush callable (e.g. "persist the newest complete own and peer
slot") on a helper thread, waits for it at most ``deadline_s``, then chains to
whatever handled the signal before - a Python handler is called, an ignored
signal stays ignored, and the default action is taken by re-raising the signal
with ``SIG_DFL``, so the process exits exactly as it would have (killed by the
signal: exit status ``-signum`` / ``128 + signum``). A second signal during
the flush chains at once.

The flush runs on a helper thread so the deadline holds even when it blocks;
if it overruns, the process still ends and its half-written temp file is
reaped by the next writer of the same scope.

A signal that arrives while the main thread itself is inside a flush (say,
an exception handler called ``flush_newest()``) must not wait for that flush
from the handler - the handler runs *on* the main thread, so the flush could
never finish. With ``busy`` given, such a signal is only recorded; the
flush's owner calls :meth:`SignalFlush.release_pending` when it is done,
which chains the signal then. The flush is neither torn nor written twice.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from lm_resiliency.errors import ConfigError

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalFlush:
    """An installed flush-on-signal hook; see :func:`install_flush_on_signal`.

    After a signal, ``fired_signal`` names it, ``flushed`` says whether the
    flush returned within the deadline and ``flush_error`` holds what it raised.
    """

    def __init__(
        self,
        flush: Callable[[], object],
        deadline_s: float,
        signals: Sequence[int],
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self._flush = flush
        self._deadline_s = deadline_s
        self._busy = busy
        self._pending: tuple[int, FrameType | None] | None = None
        self._previous: dict[int, _Handler] = {}
        self._started = threading.Event()
        self.fired_signal: int | None = None
        self.flushed = False
        self.flush_error: BaseException | None = None
        for signum in signals:
            self._previous[signum] = signal.getsignal(signum)
        try:
            for signum in signals:
                signal.signal(signum, self._handle)
        except ValueError as exc:
            self.uninstall()
            raise RuntimeError(
                "install_flush_on_signal must be called from the main thread of the main "
                f"interpreter ({exc})"
            ) from None

    def _run(self) -> None:
        try:
            self._flush()
            self.flushed = True
        except BaseException as exc:  # reported, then the signal is chained anyway
            self.flush_error = exc

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._busy is not None and self._busy():
            # The main thread is inside a flush right now (we interrupted it): let it
            # finish, then chain from there (release_pending).
            self._pending = (signum, frame)
            self.fired_signal = signum
            return
        if not self._started.is_set():
            self._started.set()
            self.fired_signal = signum
            name = signal.Signals(signum).name
            worker = threading.Thread(target=self._run, name="lmr-signal-flush", daemon=True)
            worker.start()
            worker.join(self._deadline_s)
            if worker.is_alive():
                log.error(
                    "%s: flush did not finish within %.1fs; exiting anyway", name, self._deadline_s
                )
            elif self.flush_error is not None:
                log.error("%s: flush failed: %r", name, self.flush_error)
        self._chain(signum, frame)

    def release_pending(self) -> None:
        """Chain a signal that arrived during a main-thread flush (call when it is done)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._started.set()
            self.flushed = True
            self._chain(*pending)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # SIG_DFL, or a handler installed outside Python: take the default action.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def uninstall(self) -> None:
        """Restore the previous handlers (only where ours is still installed). Main thread only."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle and previous is not None:
                signal.signal(signum, previous)


def install_flush_on_signal(
    flush: Callable[[], object],
    *,
    deadline_s: float,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
    busy: Callable[[], bool] | None = None,
) -> SignalFlush:
    """Run ``flush()`` (bounded by ``deadline_s``) when one of ``signals`` arrives, then chain.

    Call from the main thread, once the state to flush exists. ``flush`` runs
    on a helper thread while the main thread waits in the signal handler, so
    it must not need a lock the main thread could be holding at a random
    point (keep what it needs reachable without the training loop's locks).
    Raises ``ConfigError`` for a non-positive deadline and ``RuntimeError``
    off the main thread.
    """
    if not deadline_s > 0:
        raise ConfigError(f"deadline_s={deadline_s!r} must be > 0 seconds (the signal grace time)")
    return SignalFlush(flush, float(deadline_s), tuple(signals), busy)

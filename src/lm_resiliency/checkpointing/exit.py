"""Leaving the process: the exit flush and what triggers it.

:class:`ExitGuard` owns the three ways a rank's in-process slots would die
with the process, and persists a consistent set first
(:func:`~lm_resiliency.checkpointing.flush.consistent_newest`, one flush at a
time through :class:`~lm_resiliency.checkpointing.flush.ExitFlush`):

* SIGTERM / SIGINT (with ``signal_flush``, when built on the main thread): the
  handler flushes within ``signal_flush_deadline_s`` and then chains; a signal
  that arrives while the main thread is flushing is released once it finished;
* an uncaught exception (a survivor's collective error) flushes before the
  previous ``sys.excepthook`` prints it, unless the slots outlive the process
  (memory tier);
* interpreter exit without ``close()``: the background threads stop before
  torch is torn down (or the C++ runtime aborts the exit); the memory slots stay
  for the restarted worker.

:meth:`ExitGuard.close` (the manager's ``close()``) restores the previous
handlers and releases every part, in the reverse order of their construction.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from types import TracebackType

from lm_resiliency.checkpointing.flush import ExitFlush, consistent_newest
from lm_resiliency.checkpointing.setup import Parts
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.control import ControlPlane
from lm_resiliency.errors import CaptureError
from lm_resiliency.persistence import SignalFlush, install_flush_on_signal

log = logging.getLogger(__name__)

__all__ = ["ExitGuard"]


class ExitGuard:
    """One rank's exit flush and its SIGTERM/SIGINT, excepthook and atexit triggers."""

    def __init__(self, config: InMemoryCkptConfig, control: ControlPlane, parts: Parts) -> None:
        self._config = config
        self._rank = control.rank
        self._control = control
        self._engine = parts.engine
        self._channel = parts.channel
        self._peer = parts.peer
        self._flusher = parts.flusher
        self._tier = parts.tier
        self._disk = parts.disk
        self._trust = parts.trust
        self.exited = False
        """The process is exiting without ``close()``: the threads were stopped."""
        self._closed = False
        self._flush = ExitFlush(
            self._flush_consistent, deadline_s=config.signal_flush_deadline_s, after=self._after
        )
        atexit.register(self._at_exit)
        self._signal: SignalFlush | None = None
        self._excepthook: tuple[object, object] | None = None
        if config.enable and config.signal_flush:
            if threading.current_thread() is threading.main_thread():
                self._signal = install_flush_on_signal(
                    self._flush.run,
                    deadline_s=config.signal_flush_deadline_s,
                    busy=self._flush.busy_on_main_thread,
                )
                self._install_excepthook()
            else:
                log.info("manager built off the main thread: no SIGTERM/SIGINT flush installed")

    def flush(self) -> list[int]:
        """Persist a consistent set of slots now, or join the flush already running."""
        return self._flush.run()

    def close(self, *, remove_memory: bool) -> None:
        """Restore the previous handlers and release every part (the manager's ``close()``).

        ``remove_memory`` deletes the memory slots' files. Raises the capture
        worker's ``CaptureError`` once everything is released, if it had died.
        """
        self._closed = True
        self._trust.stop()
        self._flusher.close()
        atexit.unregister(self._at_exit)
        if self._signal is not None:
            self._signal.uninstall()
        if self._excepthook is not None and sys.excepthook is self._excepthook[0]:
            sys.excepthook = self._excepthook[1]  # type: ignore[assignment]
        died: CaptureError | None = None
        try:
            self._engine.close()
        except CaptureError as exc:  # the worker had stopped: raised once all is released
            died = exc
        if self._peer is not None:
            self._peer.close()
        elif self._channel is not None:
            self._channel.close()
        if self._tier is not None:
            self._tier.close(remove=remove_memory)
        self._trust.close()
        self._disk.close()
        self._control.close()
        if died is not None:
            raise died

    def _flush_consistent(self) -> list[int]:
        held = self._peer.complete_slots() if self._peer is not None else []
        chosen = consistent_newest(self._engine.complete_slots(), held)
        written = self._flusher.flush_newest(chosen, self._config.signal_flush_deadline_s)
        log.info("rank %d: flushed steps %s to %s", self._rank, written, self._config.disk_folder)
        return written

    def _after(self, owner: threading.Thread) -> None:
        if self._signal is not None and owner is threading.main_thread():
            self._signal.release_pending()

    def _install_excepthook(self) -> None:
        """An uncaught exception (a survivor's collective error) flushes slots that would die."""
        previous = sys.excepthook

        def hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            survives = self._tier is not None and self._tier.survives_process
            if not self._closed and not self.exited and not survives:
                log.warning(
                    "rank %d: exiting on %s; persisting the newest slots first (they live in "
                    "process memory)",
                    self._rank,
                    exc_type.__name__,
                )
                try:
                    self._flush.run()
                except Exception as err:  # the original error is what the user must see
                    log.warning("rank %d: exit flush failed: %s", self._rank, err)
            previous(exc_type, exc, tb)

        self._excepthook = (hook, previous)
        sys.excepthook = hook

    def _at_exit(self) -> None:
        if self._closed or self.exited:
            return
        self.exited = True
        self._trust.stop()
        self._flusher.close()
        try:
            self._engine.close()
        except CaptureError as exc:  # at exit: say it, and still release the folder
            log.error("rank %d: %s", self._rank, exc)
        if self._tier is not None:
            self._tier.close(remove=False)
        self._disk.release()

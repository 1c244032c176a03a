"""Persisting complete slots to node-local storage, off the training thread.

:class:`DiskFlusher` owns one writer thread. ``submit(slots)`` queues complete
slots (own and peer) for writing and returns at once. It takes each slot's
read guard at once and the writer releases it after the write, so a capture
that wants to reuse a slot whose write is still queued waits for it instead of
overwriting the step before it reached the disk. ``flush_newest`` persists given
complete slots synchronously (the signal and exit path) within a deadline.

:func:`consistent_newest` chooses what an exit flush persists so that a
restarted job always finds a common step when one was in memory, and
:class:`ExitFlush` makes sure only one such flush runs at a time: a second
caller (the SIGTERM handler arriving during an exception handler's flush)
joins the running one instead of waiting for its lock until a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lm_resiliency.capture.slot import Slot, SlotState
from lm_resiliency.persistence import ShardStore, TrustStatus

log = logging.getLogger(__name__)


@dataclass
class FlushStats:
    written: int = 0
    failures: int = 0
    bytes_written: int = 0
    seconds: list[float] = field(default_factory=list)
    last_error: str | None = None


class DiskFlusher:
    """Background writer of complete slots into a :class:`ShardStore`."""

    def __init__(
        self, store: Callable[[], ShardStore], *, trust: Callable[[int], TrustStatus]
    ) -> None:
        self._store = store
        self._trust = trust
        self.stats = FlushStats()
        self._queue: list[tuple[Slot, int]] = []
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lmr-flush", daemon=True)
        self._thread.start()

    def submit(self, slots: Sequence[Slot]) -> None:
        """Queue the complete ``slots`` (at their current step) for persistence.

        Each queued slot is held (its read guard) until the writer is done with it:
        a capture rotating onto it meanwhile waits instead of replacing the step
        before it was written. A slot that is no longer complete is skipped.
        """
        with self._cv:
            if self._closed:
                log.warning("disk flusher is closed: %d slot(s) not persisted", len(slots))
                return
            for s in slots:
                step = s.step
                if step is None:
                    continue
                try:
                    s.hold(step)
                except LookupError:
                    continue  # reused already: nothing of this step left to persist
                self._queue.append((s, step))
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every queued write finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def flush_newest(self, slots: Sequence[Slot], deadline_s: float) -> list[int]:
        """Synchronously persist each given complete slot not yet persisted; returns steps written.

        Used by the signal handler: bounded by ``deadline_s`` overall (a write in
        progress is not interrupted, later ones are skipped once time is up).
        """
        end = time.monotonic() + deadline_s
        written = []
        for s in slots:
            if time.monotonic() > end:
                log.warning("signal flush ran out of its %.1fs deadline", deadline_s)
                break
            fresh = s.complete and s.step is not None and s.state < SlotState.PERSISTED
            if fresh and s.step is not None and self._write(s, s.step):
                written.append(s.step)
        return written

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                slot, step = self._queue.pop(0)
                self._busy = True
            try:
                self._write(slot, step)
            finally:
                slot.unhold()  # the guard submit() took
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, slot: Slot, step: int) -> bool:
        t0 = time.perf_counter()
        try:
            with self._write_lock, slot.reading(step) as s:
                if s.state >= SlotState.PERSISTED:
                    return False
                assert s.layout is not None and s.arena is not None and s.document is not None
                assert s.owner_rank is not None
                store = self._store()
                if s.owner_rank != store.rank and store.path_for(s.owner_rank, step).exists():
                    # Owner and holder share this disk (one node): the owner already
                    # published the identical shard; a second write adds no redundancy.
                    s.advance(SlotState.PERSISTED)
                    return False
                store.write(
                    owner_rank=s.owner_rank,
                    step=step,
                    layout=s.layout,
                    arena=s.arena,
                    state_document=s.document,
                    trust=self._trust(step),
                )
                s.advance(SlotState.PERSISTED)
                self.stats.bytes_written += s.layout.total_bytes
        except LookupError:
            log.info("slot %s was reused before step %d could be persisted", slot.name, step)
            return False
        except Exception as exc:  # a failed write never stops training; it is counted
            self.stats.failures += 1
            self.stats.last_error = f"step {step} ({slot.name}): {exc}"
            log.warning("persisting step %d from %s failed: %s", step, slot.name, exc)
            return False
        self.stats.written += 1
        self.stats.seconds.append(time.perf_counter() - t0)
        return True


def flush_due(step: int, previous: int | None, *, every: int, interval: int) -> bool:
    """Whether the capture of ``step`` is persisted: a multiple of ``every``
    (``disk_flush_interval``) lies in (previous capture, this capture]; interval 5
    and flush 10 persist 10, 20, 30... ``every=0`` never persists."""
    if not every:
        return False
    before = previous if previous is not None else step - interval
    return step // every > max(before, -1) // every


def consistent_newest(own: Sequence[Slot], held: Sequence[Slot]) -> list[Slot]:
    """What an exit flush persists, most important first.

    The newest step for which this rank holds both its own slot and (where it
    holds replicas at all) its peer's replica, then a newer own slot if there
    is one: the peer of a rank whose newest own step has no matching replica
    holds that older step, so persisting the pair keeps a step in common.
    """
    mine = {s.step: s for s in own if s.complete and s.step is not None}
    theirs = {s.step: s for s in held if s.complete and s.step is not None}
    if not theirs:
        return [mine[max(mine)]] if mine else []
    common = sorted(set(mine) & set(theirs))
    out: list[Slot] = []
    if common:
        out += [mine[common[-1]], theirs[common[-1]]]
    elif mine or theirs:
        out += [x[max(x)] for x in (mine, theirs) if x]
    if mine and max(mine) not in {s.step for s in out}:
        out.append(mine[max(mine)])
    return out


@dataclass
class _Run:
    owner: threading.Thread
    done: threading.Event = field(default_factory=threading.Event)
    result: list[int] = field(default_factory=list)


class ExitFlush:
    """One exit flush at a time, from any thread; a second caller joins the running one.

    ``after(owner_thread)`` runs once a flush has finished (the manager uses it
    to chain a SIGTERM that arrived while the main thread was flushing).
    """

    def __init__(
        self,
        flush: Callable[[], list[int]],
        *,
        deadline_s: float,
        after: Callable[[threading.Thread], Any] | None = None,
    ) -> None:
        self._flush = flush
        self._deadline_s = deadline_s
        self._after = after
        self._lock = threading.Lock()
        self._running: _Run | None = None

    def busy_on_main_thread(self) -> bool:
        """Whether the main thread itself is inside a flush (a signal handler interrupted it)."""
        run = self._running
        return run is not None and run.owner is threading.main_thread()

    def run(self) -> list[int]:
        """Flush now, or join the flush that is already running; returns the steps written."""
        me = threading.current_thread()
        with self._lock:
            run = self._running
            started = run is None
            if run is None:
                run = self._running = _Run(me)
        if not started:
            if run.owner is not me:
                run.done.wait(self._deadline_s)
            return list(run.result)
        try:
            run.result = self._flush()
        finally:
            with self._lock:
                self._running = None
            run.done.set()
            if self._after is not None:
                self._after(me)
        return list(run.result)

"""The cross-replica process group of one membership epoch, with polled waits.

Call order (every member of epoch ``E``, group rank ``g``)::

    group = CrossReplicaGroup.build(view, epoch=E, members=record.members)
    fut = group.allreduce(bucket)         # SUM in place; a Future *we* complete
    group.wait(fut)                       # or DDP waits on it inside backward()
    ...                                   # on EpochFailed: view.reform(...), then
    group.abandon()                       # never reused; a new group for E+1

* The group is a ``ProcessGroupGloo`` built directly on
  ``PrefixStore(Keys.group_prefix(E, g), coordinator store)`` with ``rank =
  members.index(replica)`` and ``size = len(members)`` (never ``dist.new_group``, which is
  collective over the torchrun's own default group).
* Nothing waits on Gloo's own timeout. One watcher thread per process holds every pending
  work: a work that finishes completes its future from Gloo's callback; while any work is
  pending the watcher checks ``view.failed()`` every ``poll_slice_s``. On a Gloo error or the
  flag every pending future of the group completes with :class:`EpochFailed`, and a rank
  that saw the error itself publishes ``fail/<E>`` (``view.report_failure``) from the
  watcher thread, so its peers blocked in the ring learn of it one slice later.
* An abandoned group is aborted (``pg.abort()``) and kept in a per-process graveyard until
  exit: destroying a Gloo group whose pairs broke can ``std::terminate`` the process. The
  graveyard is capped (:data:`GRAVEYARD_CAP`); past it, building a group raises
  :class:`GraveyardFull` and the job falls back to a restart.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.live.view import EpochFailed, MembershipView

__all__ = ["GRAVEYARD_CAP", "CrossReplicaGroup", "GraveyardFull", "graveyard_size"]

GRAVEYARD_CAP = 32
"""Abandoned groups one process keeps (each holds Gloo threads and sockets until
``pg_timeout_s`` after its failure)."""


class GraveyardFull(ResiliencyError):
    """Too many membership changes in one process: it falls back to a restart."""


class CrossReplicaGroup:
    """One epoch's cross-replica Gloo group of one group rank; see the module doc."""

    def __init__(
        self,
        view: MembershipView,
        pg: dist.ProcessGroupGloo,
        *,
        epoch: int,
        members: tuple[int, ...],
        poll_slice_s: float,
        pg_timeout_s: float,
    ) -> None:
        self.view = view
        self.pg = pg
        self.epoch = epoch
        self.members = members
        self.rank = members.index(view.replica)
        self.size = len(members)
        self.poll_slice_s = poll_slice_s
        self.pg_timeout_s = pg_timeout_s
        self.build_s = 0.0
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._inflight: list[dist.Work] = []
        """Gloo works not yet completed (a callback of ours is attached to each)."""
        self._failure: EpochFailed | None = None
        self._report: str | None = None
        self._abandoned = False

    @classmethod
    def build(
        cls,
        view: MembershipView,
        *,
        epoch: int,
        members: Sequence[int],
        poll_slice_s: float = 0.05,
        pg_timeout_s: float = 30.0,
    ) -> CrossReplicaGroup:
        """Rendezvous with the other members of ``epoch`` (collective over ``members``).

        Blocks until every member built its side, bounded by ``pg_timeout_s``. Raises
        ``ValueError`` when this replica is not in ``members`` and :class:`GraveyardFull`
        when the process has abandoned :data:`GRAVEYARD_CAP` groups already.
        """
        members = tuple(members)
        if list(members) != sorted(set(members)):
            raise ValueError(f"members {members} must be distinct replica ids, sorted")
        if view.replica not in members:
            raise ValueError(
                f"replica {view.replica} is not a member of epoch {epoch} (members {members}); "
                "a process outside the membership cannot build its group"
            )
        if len(_GRAVEYARD) >= GRAVEYARD_CAP:
            raise GraveyardFull(
                f"this process abandoned {len(_GRAVEYARD)} cross-replica groups (the cap is "
                f"{GRAVEYARD_CAP}); too many membership changes in one process, falling back "
                "to a whole-job restart with memory recovery"
            )
        t0 = time.perf_counter()
        prefix = view.keys.group_prefix(epoch, view.group_rank)
        # Its own store client: Gloo's rendezvous must not share one with the caller's polls.
        store = dist.PrefixStore(prefix, _clone(view.store()))
        pg = dist.ProcessGroupGloo(
            store, members.index(view.replica), len(members), timedelta(seconds=pg_timeout_s)
        )
        group = cls(
            view,
            pg,
            epoch=epoch,
            members=members,
            poll_slice_s=poll_slice_s,
            pg_timeout_s=pg_timeout_s,
        )
        group.build_s = time.perf_counter() - t0
        return group

    # -- collectives -----------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """SUM ``tensor`` in place over the members; the future yields ``tensor``.

        The future fails with :class:`EpochFailed` within one poll slice of a lost member.
        """
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        failure = self._failure
        if failure is not None:
            _set_error(fut, failure)
            return fut
        try:
            work = cast(Any, self.pg).allreduce([tensor])  # the Backend stub lacks it
        except RuntimeError as exc:
            self._fail(f"all-reduce could not start: {_first_line(exc)}", seen=True)
            _set_error(fut, cast(EpochFailed, self._failure))
            return fut
        self._track(work, fut, tensor)
        return fut

    def polled_wait(self, work: dist.Work) -> None:
        """Wait for a work of this group (one of MTGS's small collectives), in slices.

        Raises :class:`EpochFailed` within one slice of a Gloo error or the failure flag.
        """
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._track(work, fut, None)
        self.wait(fut)

    def wait(self, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """Wait for a future of :meth:`allreduce`; raises its :class:`EpochFailed`."""
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        # The watcher completes it within a slice of a failure; the bound only guards
        # against a watcher that died (a bug), and then names it.
        if not done.wait(self.pg_timeout_s + 10 * self.poll_slice_s):
            self._fail("no completion within pg_timeout_s (the watcher thread stalled)", seen=True)
        return fut.value()

    def failure(self) -> EpochFailed | None:
        """The failure of this epoch seen so far, if any."""
        return self._failure

    # -- leaving ---------------------------------------------------------------

    def abandon(self, cause: str = "abandoned") -> None:
        """Fail what is pending, abort the Gloo group and keep it until exit. Idempotent."""
        self._fail(cause, seen=False)
        self._flush_report()
        with self._report_lock, self._lock:
            if self._abandoned:
                return
            self._abandoned = True
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):  # already broken: nothing more to stop
                abort()
        with self._lock:
            inflight = [w for w in self._inflight if not w.is_completed()]
        _bury(self.pg, inflight, time.monotonic() + self.pg_timeout_s + 1.0)

    # -- internals -------------------------------------------------------------

    def _track(
        self, work: dist.Work, fut: torch.futures.Future[torch.Tensor], tensor: torch.Tensor | None
    ) -> None:
        entry = _Pending(self, fut, tensor, work)
        with self._lock:
            self._pending.append(entry)
            self._inflight.append(work)
        _WATCHER.add(self)
        work.get_future().add_done_callback(entry.on_work_done)

    def _fail(self, cause: str, *, seen: bool) -> None:
        """Fail every pending future with ``EpochFailed``; ``seen``: this rank saw the error."""
        with self._lock:
            if self._failure is None:
                self._failure = EpochFailed(self.epoch, cause)
                if seen:
                    self._report = cause
            failure = self._failure
            pending, self._pending = self._pending, []
            report = self._report is not None
        for entry in pending:
            entry.finish(failure)
        if report:
            _WATCHER.wake()  # publish fail/<E> now, not a slice later: peers wait on it

    def _flush_report(self) -> None:
        # Under its own lock, which abandon() takes too: a report for epoch E must never
        # land after this process adopted E+1 (the view reports for its current epoch).
        with self._report_lock:
            with self._lock:
                report, self._report = self._report, None
                if self._abandoned:
                    return
            if report is not None:
                # Best effort: the coordinator also sees the dead peer's EOF or lease.
                with contextlib.suppress(Exception):
                    self.view.report_failure(report)

    def _done(self, entry: _Pending) -> None:
        with self._lock:
            if entry in self._pending:
                self._pending.remove(entry)

    def _work_done(self, work: dist.Work) -> None:
        with self._lock:
            if work in self._inflight:
                self._inflight.remove(work)

    def _poll(self) -> bool:
        """One watcher slice; returns whether anything is still pending."""
        self._flush_report()
        with self._lock:
            busy = bool(self._pending)
        if busy and self._failure is None:
            cause = self.view.failed()
            if cause is not None:
                self._fail(f"failure flag: {cause}", seen=False)
        with self._lock:
            return bool(self._pending) or self._report is not None


@dataclass(eq=False)
class _Pending:
    group: CrossReplicaGroup
    future: torch.futures.Future[torch.Tensor]
    tensor: torch.Tensor | None
    work: dist.Work
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if error is not None:
            _set_error(self.future, error)
        else:
            self.future.set_result(self.tensor if self.tensor is not None else torch.empty(0))

    def on_work_done(self, work_future: torch.futures.Future[list[torch.Tensor]]) -> None:
        # Runs on a Gloo thread: complete at once on success (no watcher hop on the
        # healthy path); an error fails the whole epoch.
        self.group._work_done(self.work)
        try:
            work_future.value()
        except Exception as exc:  # any Gloo error means a lost peer
            self.group._fail(_first_line(exc), seen=True)
            return
        self.group._done(self)
        self.finish(None)


class _Watcher:
    """The per-process thread that polls the failure flag while a collective is pending."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._groups: list[CrossReplicaGroup] = []
        self._thread: threading.Thread | None = None

    def add(self, group: CrossReplicaGroup) -> None:
        with self._cond:
            if group not in self._groups:
                self._groups.append(group)
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lmr-live-watcher", daemon=True
                )
                self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._groups:
                    self._cond.wait()
                groups = list(self._groups)
                slice_s = min(g.poll_slice_s for g in groups)
            idle = [g for g in groups if not g._poll()]
            with self._cond:
                for g in idle:
                    if g in self._groups and not g._pending:
                        self._groups.remove(g)
                if self._groups:
                    self._cond.wait(slice_s)


_WATCHER = _Watcher()
_GRAVEYARD: list[object] = []
_UNFINISHED: list[tuple[list[dist.Work], float]] = []
"""Per abandoned group: its works still pending (ours has a Python callback on each) and
the monotonic time by which Gloo's own timeout fails them."""


def graveyard_size() -> int:
    """Abandoned groups this process keeps alive until exit."""
    return len(_GRAVEYARD)


def _bury(pg: object, inflight: list[dist.Work], deadline: float) -> None:
    if not _GRAVEYARD:
        atexit.register(_drain_at_exit)
    _GRAVEYARD.append(pg)
    # Never destroyed, not even by the interpreter's teardown: destroying a group whose
    # pairs broke can std::terminate the process (measured), so it exits with the group.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    if inflight:
        _UNFINISHED.append((inflight, deadline))


def _drain_at_exit() -> None:
    """Let an abandoned work fail while Python is still whole (bounded by its timeout).

    A survivor that was not the dead peer's ring neighbour keeps its abandoned all-reduce
    pending (``abort()`` does not fail it). It fails when a peer's exit closes the socket,
    and then runs our callback; during the interpreter's teardown that crashed the process
    (SIGSEGV, measured). Peers exit together at the end of a job, so this wait is short.
    """
    for works, deadline in _UNFINISHED:
        while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
            time.sleep(0.01)


def _set_error(fut: torch.futures.Future[torch.Tensor], error: BaseException) -> None:
    # torch's stub types the argument as the result type; it takes an exception.
    cast(Any, fut).set_exception(error)


def _clone(store: dist.Store) -> dist.Store:
    clone = getattr(store, "clone", None)
    return cast(dist.Store, clone()) if clone is not None else store


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

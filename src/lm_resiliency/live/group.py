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

NCCL (``backend="nccl"``, or ``None`` with ``device`` on CUDA; see ``live.backend``):

* A ``ProcessGroupNCCL`` on the same ``PrefixStore``, built after
  :func:`~lm_resiliency.live.backend.prepare_nccl_env` made NCCL's watchdog keep the process
  alive (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``). ``build`` runs a one-element all-reduce so
  that the communicator exists when it returns (NCCL would otherwise create it inside the
  first bucket's all-reduce), which makes ``build`` the rendezvous as on Gloo.
* An NCCL work's future is complete on the host as soon as the kernel is queued, so it says
  nothing about the collective. The watcher polls ``work.is_completed()`` instead (every
  :data:`NCCL_COMPLETION_POLL_S` while an NCCL work is pending; the failure flag is still
  read once per ``poll_slice_s``) and completes our future once the GPU has finished it.
* With ``shrink=True`` (the default) and an NCCL build that supports it (NCCL >= 2.27),
  ``abandon`` keeps the failed communicator and :meth:`CrossReplicaGroup.successor` shrinks
  it to the new members (``Backend.shrink(dead_ranks, SHRINK_ABORT)``, the operation
  ``dist.shrink_group`` calls; that wrapper needs a group registered with
  ``torch.distributed`` and a default group, ours are neither). Otherwise, or when members
  joined, the failed communicator is aborted (``pg.abort()``, ``ncclCommAbort``) and a new
  group is built. The choice is a function of the two member lists and the build, so every
  survivor makes the same one (shrinking is collective over the survivors).
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
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.live.backend import prepare_nccl_env, resolve_backend
from lm_resiliency.live.view import CoordinatorLost, EpochFailed, MembershipView

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend

__all__ = [
    "GRAVEYARD_CAP",
    "NCCL_COMPLETION_POLL_S",
    "CrossReplicaGroup",
    "GraveyardFull",
    "graveyard_size",
]

GRAVEYARD_CAP = 32
"""Abandoned groups one process keeps (each holds Gloo threads and sockets until
``pg_timeout_s`` after its failure)."""

NCCL_COMPLETION_POLL_S = 0.001
"""How often the watcher asks a pending NCCL work ``is_completed()`` (a CUDA event query,
microseconds); the failure flag is still read once per ``poll_slice_s``."""

SHRINK_ABORT = 0x01
"""``ncclCommShrink``'s flag: abort the parent's outstanding operations first (c10d's
``SHRINK_ABORT``)."""


class GraveyardFull(ResiliencyError):
    """Too many membership changes in one process: it falls back to a restart."""


class CrossReplicaGroup:
    """One epoch's cross-replica Gloo or NCCL group of one group rank; see the module doc."""

    def __init__(
        self,
        view: MembershipView,
        pg: C10dBackend,
        *,
        epoch: int,
        members: tuple[int, ...],
        poll_slice_s: float,
        pg_timeout_s: float,
        backend: str = "gloo",
        device: torch.device | None = None,
        shrink: bool = False,
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
        self.backend = backend
        self.device = device if device is not None else torch.device("cpu")
        self._shrink_requested = shrink
        self.shrink = shrink and backend == "nccl" and _supports_shrinking(pg)
        """Whether :meth:`successor` may shrink this group's communicator (NCCL only)."""
        self.rebuild_kind = "build"
        """How this group came to be: ``"build"`` (a new group) or ``"shrink"``."""
        self._aborted = False
        self._next_flag_check = 0.0
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
        backend: str | None = None,
        device: torch.device | str | None = None,
        shrink: bool = True,
    ) -> CrossReplicaGroup:
        """Rendezvous with the other members of ``epoch`` (collective over ``members``).

        ``device``: where the reduced tensors live; ``backend``: ``"gloo"``, ``"nccl"`` or
        ``None`` (NCCL for a CUDA device). ``shrink``: on NCCL, let :meth:`successor` shrink
        the communicator after a loss (every member must pass the same value).

        Blocks until every member built its side, bounded by ``pg_timeout_s``. Raises
        ``ValueError`` when this replica is not in ``members`` or the backend does not fit
        the device, and :class:`GraveyardFull` when the process has abandoned
        :data:`GRAVEYARD_CAP` groups already.
        """
        chosen = resolve_backend(backend, device)
        dev = torch.device(device) if device is not None else torch.device("cpu")
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
        client = _clone(view.store())
        store = dist.PrefixStore(prefix, client)
        rank, size = members.index(view.replica), len(members)
        timeout = timedelta(seconds=pg_timeout_s)
        pg: C10dBackend
        if chosen == "nccl":
            prepare_nccl_env()
            client.set_timeout(timeout)  # bounds NCCL's unique-id exchange through the store
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        group = cls(
            view,
            pg,
            epoch=epoch,
            members=members,
            poll_slice_s=poll_slice_s,
            pg_timeout_s=pg_timeout_s,
            backend=chosen,
            device=dev,
            shrink=shrink,
        )
        if chosen == "nccl":
            # Create the communicator now (collective): a lost peer fails the build here,
            # in a polled wait, not inside the first bucket's all-reduce.
            group.wait(group.allreduce(torch.zeros(1, device=dev)))
        group.build_s = time.perf_counter() - t0
        return group

    def successor(self, *, epoch: int, members: Sequence[int]) -> CrossReplicaGroup:
        """The group of ``epoch`` after this abandoned one (collective over ``members``).

        Shrinks this NCCL communicator when :attr:`shrink` holds and ``members`` are a
        subset of this epoch's (a pure loss); otherwise aborts it and builds a new group
        with the same settings. Call after :meth:`abandon` and the view's ``reform``.
        """
        members = tuple(members)
        if not self._abandoned:
            raise RuntimeError(
                f"successor() of epoch {self.epoch} called on a live group; abandon() it first"
            )
        lost = [self.members.index(m) for m in self.members if m not in members]
        if self.shrink and not self._aborted and lost and set(members) <= set(self.members):
            if self.view.replica not in members:
                raise ValueError(
                    f"replica {self.view.replica} is not a member of epoch {epoch} (members "
                    f"{members}); a process outside the membership cannot build its group"
                )
            t0 = time.perf_counter()
            try:
                new_pg = cast(Any, self.pg).shrink(lost, SHRINK_ABORT)
            except RuntimeError:
                new_pg = None  # fall back to a new group (bounded by pg_timeout_s there)
            self._abort()
            if new_pg is not None:
                group = type(self)(
                    self.view,
                    cast("C10dBackend", new_pg),
                    epoch=epoch,
                    members=members,
                    poll_slice_s=self.poll_slice_s,
                    pg_timeout_s=self.pg_timeout_s,
                    backend=self.backend,
                    device=self.device,
                    shrink=True,
                )
                group.rebuild_kind = "shrink"
                group.build_s = time.perf_counter() - t0
                return group
        self._abort()
        return type(self).build(
            self.view,
            epoch=epoch,
            members=members,
            poll_slice_s=self.poll_slice_s,
            pg_timeout_s=self.pg_timeout_s,
            backend=self.backend,
            device=self.device,
            shrink=self._shrink_requested,
        )

    # -- collectives -----------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """SUM ``tensor`` in place over the members; the future yields ``tensor``.

        The future fails with :class:`EpochFailed` within one poll slice of a lost member.
        """
        if self.backend == "nccl" and tensor.device.type != "cuda":
            raise ValueError(
                f"all-reduce of a {tensor.device} tensor on epoch {self.epoch}'s NCCL group; "
                f"move it to {self.device} first, or build the group with backend='gloo'"
            )
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
        """Fail what is pending, abort the group and keep it until exit. Idempotent.

        A shrinkable NCCL group (:attr:`shrink`) is not aborted here: :meth:`successor`
        shrinks it (or aborts it), and :meth:`close` aborts it when no successor comes.
        """
        self._fail(cause, seen=False)
        self._flush_report()
        with self._report_lock, self._lock:
            if self._abandoned:
                return
            self._abandoned = True
        if not self.shrink:
            self._abort()
        with self._lock:
            # NCCL works carry no Python callback of ours: nothing to drain at exit.
            inflight = [] if self.backend == "nccl" else self._unfinished()
        _bury(self.pg, inflight, time.monotonic() + self.pg_timeout_s + 1.0)

    def close(self) -> None:
        """Abandon and abort now (a kept NCCL communicator too), for a process that leaves."""
        self.abandon("closed")
        self._abort()

    def _abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):  # already broken: nothing more to stop
                abort()

    def _unfinished(self) -> list[dist.Work]:
        return [w for w in self._inflight if not w.is_completed()]

    # -- internals -------------------------------------------------------------

    def _track(
        self, work: dist.Work, fut: torch.futures.Future[torch.Tensor], tensor: torch.Tensor | None
    ) -> None:
        entry = _Pending(self, fut, tensor, work)
        with self._lock:
            self._pending.append(entry)
            self._inflight.append(work)
        _WATCHER.add(self)
        if self.backend != "nccl":
            work.get_future().add_done_callback(entry.on_work_done)
        # NCCL: the work's future completes when the kernel is queued; the watcher polls
        # work.is_completed() instead (_poll_completions).

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
        if self.backend == "nccl":
            self._poll_completions()
        with self._lock:
            busy = bool(self._pending)
        if busy and self._failure is None and self._flag_due():
            try:
                cause = self.view.failed()
            except CoordinatorLost:
                # The collective does not need the coordinator: it completes (or fails on a
                # lost peer) on every member alike, and the caller raises the loss at its
                # next step boundary (or reform). Failing it here could end the step on
                # some members only: their memory would then hold different steps.
                cause = None
            except Exception as exc:  # Evicted: the caller's reform raises it; never die here
                first = (str(exc).strip().splitlines() or [""])[0]
                self._fail(f"membership: {type(exc).__name__}: {first}", seen=False)
                cause = None
            if cause is not None:
                self._fail(f"failure flag: {cause}", seen=False)
        with self._lock:
            return bool(self._pending) or self._report is not None

    def _slice_s(self) -> float:
        """How long the watcher may sleep for this group."""
        if self.backend == "nccl" and self._pending:
            return min(self.poll_slice_s, NCCL_COMPLETION_POLL_S)
        return self.poll_slice_s

    def _flag_due(self) -> bool:
        if self.backend != "nccl":
            return True  # Gloo: the watcher wakes once per slice (or on news) anyway
        now = time.monotonic()
        if now < self._next_flag_check:
            return False
        self._next_flag_check = now + self.poll_slice_s
        return True

    def _poll_completions(self) -> None:
        """NCCL: complete the pending futures whose work the GPU has finished (or failed)."""
        with self._lock:
            pending = list(self._pending)
        for entry in pending:
            if not entry.work.is_completed():  # a CUDA event query; also sees NCCL errors
                continue
            self._work_done(entry.work)
            error = entry.work.exception()
            if error is not None:
                self._fail(_first_line(error), seen=True)
                return
            self._done(entry)
            entry.finish(None)


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
                slice_s = min(g._slice_s() for g in groups)
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


def _supports_shrinking(pg: object) -> bool:
    try:
        return bool(getattr(pg, "supports_shrinking", False))
    except RuntimeError:
        return False


def _clone(store: dist.Store) -> dist.Store:
    clone = getattr(store, "clone", None)
    return cast(dist.Store, clone()) if clone is not None else store


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The asynchronous capture engine: snapshot on the caller's thread, copy in the background.

Call order (one thread, the training loop)::

    engine.capture(state, step)   # returns after launching; cost independent of bytes
    ...forward/backward of the next step...
    engine.wait_captured()        # before the captured tensors are modified again
    optimizer.step()

``capture`` encodes the non-tensor state (unsupported values fail here, on the
caller's thread), picks the target slot, records one CUDA event per device on
the current stream and hands the cycle to the completion worker. After the
first capture, subtrees marked :class:`~lm_resiliency.state.Deferred` (values
already a snapshot, e.g. ``enable_resiliency``'s model and optimizer state) are
walked and laid out by the worker instead; what that raises comes out of the
next call unwrapped, with a note naming the step. The worker then
sizes the slot's arena (allocation and pre-faulting stay off the training
thread), enqueues the device tensors' copies on a side stream that first waits
for that event, copies host tensors itself (``copy_`` releases the GIL) and waits
for the side stream's completion event. The cycle holds a reference to every
source until its copy completed, so a source the caller drops right after
``save()`` cannot have its memory reused early. When the bytes are complete the
worker publishes the slot and runs the ``after_capture`` hook (replication);
``wait_captured`` returns once that hook has *started*. The next ``capture``
waits for the whole previous cycle, so a slot is never reused mid-transfer.

After the bytes are complete (``wait_captured`` may return), the worker
computes one CRC-32C per chunk of the arena and *seals* the slot (a slot on
the memory filesystem writes its commit record with them), all off the
training thread.

After a recovery from own memory, :meth:`CaptureEngine.hand_over` hands the
recovered slot to the caller (zero-copy: the live state aliases its arena) and,
when the slots outlive the process, *re-protects* the step: the worker copies
the handed-over arena into a fresh own slot and commits it for the same step,
timeline and document with the checksums it was recorded with (recomputed on
the copy and compared), without the ``after_capture`` hook (no replication,
no flush). ``wait_captured`` waits for that copy as for a capture's.

Errors of the worker's copy are recorded and raised as :class:`CaptureError`
(naming the step) on the caller's next call; they are never swallowed. A
worker that stops altogether (anything escaping its loop) never leaves a
caller waiting: every wait (``capture``, ``wait_captured``, ``wait_idle``,
``close``) then raises :class:`CaptureError` with the worker's error as its
cause, on every later call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_resiliency._compat import add_note
from lm_resiliency.capture.gate import CommitGate
from lm_resiliency.capture.layout import Layout
from lm_resiliency.capture.slot import ANONYMOUS, ArenaBacking, ArenaHandle, Slot
from lm_resiliency.checksums import arena_crcs
from lm_resiliency.errors import CaptureError
from lm_resiliency.knobs import CAPTURE_WORKER_POLL_S, HOST_COPY_PIECE_BYTES
from lm_resiliency.state import EncodedState, PartialEncoding, begin_encoding, encode_state

log = logging.getLogger(__name__)

_CUDA = torch.cuda.is_available()


@dataclass
class CaptureStats:
    """Timings of the hot path; blocking = time in ``capture`` + time in ``wait_captured``."""

    captures: int = 0
    save_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)
    crc_s: list[float] = field(default_factory=list)
    """Worker seconds checksumming each capture (after ``wait_captured`` could return)."""
    allocations: int = 0
    relayouts: int = 0
    failures: int = 0
    discarded: int = 0
    """Held captures discarded before their commit (a refused :class:`CommitGate`)."""
    kept_copy_s: list[float] = field(default_factory=list)
    """Worker seconds allocating a slot for and copying each handed-over step back into own
    memory (:meth:`CaptureEngine.hand_over`)."""
    kept_wait_s: list[float] = field(default_factory=list)
    """Caller seconds ``wait_captured`` waited for such a copy (not in ``wait_s``)."""


@dataclass
class _Keep:
    """A handed-over own slot to copy back into own memory (see ``CaptureEngine.hand_over``)."""

    source: torch.Tensor | None
    """The handed-over arena (the live state aliases it); dropped once copied."""
    document: dict[str, Any]
    timeline: str | None
    crcs: tuple[int, ...] | None
    """The checksums the slot was recorded with; the copy is committed only if it matches."""


@dataclass
class _Cycle:
    step: int
    slot: Slot
    layout: Layout | None
    encoded: EncodedState | None
    ready: dict[torch.device, Any]  # device -> torch.cuda.Event recorded in save()
    start: float
    partial: PartialEncoding | None = None
    """Set when the walk of the tree's deferred parts is left to the worker."""
    captured: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    keep: _Keep | None = None
    """Set for the re-protection of a handed-over slot instead of a capture."""
    gate: CommitGate | None = None
    """Set for a held capture: its commit waits for the gate's decision."""


@dataclass(frozen=True)
class Adopted:
    """A committed capture that outlived an earlier process, to be taken over by a slot."""

    slot_name: str
    handle: ArenaHandle
    layout: Layout
    step: int
    document: dict[str, Any]
    timeline: str | None
    crcs: tuple[int, ...] | None = None
    """The checksums its record carries (checked before the slot's bytes are used)."""


def adopt_into(slots: list[Slot], adopted: Sequence[Adopted], *, owner_rank: int) -> list[Slot]:
    """Give each adopted capture to the slot of its name; the slots, newest complete first."""
    by_name = {s.name: s for s in slots}
    for a in adopted:
        by_name[a.slot_name].adopt(
            a.handle,
            a.layout,
            step=a.step,
            document=a.document,
            owner_rank=owner_rank,
            timeline=a.timeline,
            crcs=a.crcs,
        )
    complete = [s for s in slots if s.complete]
    empty = [s for s in slots if not s.complete]
    return sorted(complete, key=lambda s: s.step or 0, reverse=True) + empty


AfterCapture = Callable[[Slot], None]
PlanArenas = Callable[[int], None]
CheckLayout = Callable[[Layout], None]
"""Called on the caller's thread with a new layout's byte size before its first copy."""


class CaptureEngine:
    """Owns the own-state slots and the completion worker of one rank.

    ``num_slots`` own slots rotate: the newest complete capture is always kept
    while the next one is being filled (``own_current`` / ``own_previous``).
    ``after_capture(slot)`` runs on the worker once a slot is complete.
    ``backing`` allocates the arenas (process memory by default);
    ``plan_arenas(nbytes)`` runs on the caller's thread whenever the layout
    changes, before any slot is sized for it (a budget check that may raise).
    ``check_layout(layout)`` runs whenever the layout of a state tree captured
    with :meth:`capture` changes (never for :meth:`capture_tensors`): the caller
    that may write the tree to disk passes the format's check (the manager passes
    ``persistence.format.check_storable``), so the engine itself knows no format.
    ``checksums=False`` seals slots without CRC-32C (``slot.crcs`` stays ``None``):
    for a copy that never leaves the process (the MTGS shadow, restored in place);
    a memory-tier backing refuses such a slot.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        pin_memory: bool = True,
        rate_limit_bytes_per_s: int | None = None,
        after_capture: AfterCapture | None = None,
        num_slots: int = 2,
        backing: ArenaBacking = ANONYMOUS,
        plan_arenas: PlanArenas | None = None,
        check_layout: CheckLayout | None = None,
        checksums: bool = True,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: the capture engine needs at least 1 slot")
        self.rank = rank
        self.pin_memory = pin_memory
        self.rate_limit = rate_limit_bytes_per_s
        self.after_capture = after_capture
        self.slots = [Slot(f"own_{i}", backing=backing) for i in range(num_slots)]
        self._plan_arenas = plan_arenas
        self._check_layout = check_layout
        self.checksums = checksums
        self.stats = CaptureStats()
        self._layout: Layout | None = None
        self._layout_key: tuple[Any, ...] | None = None
        self._devices: set[torch.device] = set()  # accelerators of the latest layout's tensors
        self._cycle: _Cycle | None = None
        self._pending_error: BaseException | None = None
        self._jobs: list[_Cycle] = []
        self._cv = threading.Condition()
        self._closed = False
        self._streams: dict[torch.device, Any] = {}
        self._running: _Cycle | None = None
        self._spare: tuple[threading.Event, threading.Event] | None = None
        """The next capture's events, made off the caller's thread (``_take_events``)."""
        self._death: BaseException | None = None
        """What stopped the worker thread (``None`` while it runs)."""
        self._worker = threading.Thread(target=self._run, name=f"lmr-capture-r{rank}", daemon=True)
        self._worker.start()

    # ----------------------------------------------------------------- caller side
    @property
    def current(self) -> Slot:
        """``own_current``: the slot of the newest (or in-flight) capture."""
        return self.slots[0]

    @property
    def previous(self) -> Slot | None:
        """``own_previous``: the prior complete capture (None with a single slot)."""
        return self.slots[1] if len(self.slots) > 1 else None

    def capture(self, state: Any, step: int, *, gate: CommitGate | None = None) -> None:
        """Launch the capture of ``state`` at ``step``; returns without waiting for bytes.

        ``gate``: hold the commit until the gate is decided (see
        :mod:`~lm_resiliency.capture.gate`). Waits for the previous cycle (copy
        and replication, after resolving its gate) first. Raises
        ``StateEncodingError`` for unsupported values (also a tensor dtype the
        node-local shard format cannot store, checked when the layout changes)
        and ``CaptureError`` for a failure of an earlier background cycle.
        """
        t0 = time.perf_counter()
        self._finish_previous()
        if self._layout is None:
            # The first capture is encoded here, so its errors are raised by this call.
            self._launch(encode_state(state), step, t0, persisted=True, gate=gate)
            return
        # Later ones leave the walk of Deferred subtrees (model and optimizer state) to the
        # worker; what it raises (an unsupported value, no room for a new layout) comes out
        # of the next call on this thread, unwrapped.
        partial = begin_encoding(state)
        slot = self._rotate()
        ready = self._record_ready_on(self._devices)
        captured, finished = self._take_events()
        self._submit(
            _Cycle(step, slot, None, None, ready, t0, partial, captured, finished, gate=gate)
        )

    def capture_tensors(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str], step: int
    ) -> None:
        """Like :meth:`capture` for a flat list of uniquely named tensors (no state tree).

        Used by the MTGS shadow, which keeps its own bookkeeping of what each
        tensor is; the slot's document is empty.
        """
        t0 = time.perf_counter()
        self._finish_previous()
        self._launch(EncodedState(document={}, tensors=list(tensors), names=list(names)), step, t0)

    def _launch(
        self,
        encoded: EncodedState,
        step: int,
        t0: float,
        persisted: bool = False,
        gate: CommitGate | None = None,
    ) -> None:
        layout = self._layout_for(encoded, persisted)
        slot = self._rotate()
        # Device tensors: remember where the compute stream is now; the worker's side
        # stream waits for this event before copying. The cycle keeps a reference to
        # every source tensor until its copy completed, so the caching allocator cannot
        # hand a source's memory to new work even if the caller drops it right away.
        ready = self._record_ready(encoded.tensors)
        self._submit(_Cycle(step, slot, layout, encoded, ready, t0, gate=gate))

    def _take_events(self) -> tuple[threading.Event, threading.Event]:
        """A cycle's two events, made by the worker while it ran the previous cycle.

        Read only after that cycle finished (``_finish_previous``) and before the next
        job is queued, so the worker is not writing ``_spare`` then.
        """
        spare, self._spare = self._spare, None
        return spare if spare is not None else (threading.Event(), threading.Event())

    def _submit(self, cycle: _Cycle) -> None:
        self._enqueue(cycle)
        self.stats.captures += 1
        self.stats.save_s.append(time.perf_counter() - cycle.start)

    def wait_captured(self) -> None:
        """Block until the in-flight capture's bytes are complete and its follow-up started.

        Call before modifying the captured tensors again. Cheap when nothing is in flight.
        """
        cycle = self._cycle
        if cycle is None:
            self._raise_pending()
            return
        t0 = time.perf_counter()
        if not cycle.captured.is_set():  # the usual case, a copy done during the step: no wait
            self._wait_for(cycle.captured)
        waited = self.stats.kept_wait_s if cycle.keep is not None else self.stats.wait_s
        waited.append(time.perf_counter() - t0)
        self._raise_pending()
        self._raise_if_dead()

    def wait_idle(self) -> None:
        """Block until the in-flight cycle (including its follow-up) has finished."""
        self._finish_previous()

    @property
    def layout(self) -> Layout | None:
        """The layout of the newest launched capture (known before its bytes are copied)."""
        return self._layout

    def adopt(self, adopted: Sequence[Adopted]) -> None:
        """Take over complete captures an earlier process left, newest step first into
        ``own_current``. Call before the first capture.
        """
        self.slots = adopt_into(self.slots, adopted, owner_rank=self.rank)

    def hand_over(self, consume: Callable[[], object], *, keep: bool) -> None:
        """Run ``consume`` (a recovery's hand-over of an own slot) and, with ``keep``,
        re-protect the handed-over step in own memory in the background.

        ``consume`` is :meth:`Slot.take` of one of this engine's complete slots
        (raises ``LookupError`` when already taken). With ``keep`` (the slots
        outlive the process) the worker copies the handed-over arena into that
        slot's fresh arena and commits it for the same step, timeline and
        document once its CRC-32C match the recorded ones; no ``after_capture``
        (the peer already holds the step). The slot becomes ``own_current``, so
        the next capture turns it into ``own_previous``. ``wait_captured``
        waits for the copy: call it before the live state changes.
        """
        self._finish_previous()
        before = {id(s): (s, s.step, s.timeline, s.crcs) for s in self.slots if s.complete}
        result = consume()
        taken = [v for v in before.values() if not v[0].complete]
        if not keep or len(taken) != 1 or not isinstance(result, tuple) or len(result) != 3:
            return
        slot, step, timeline, crcs = taken[0]
        layout, arena, document = result
        assert step is not None
        self.slots = [slot, *(s for s in self.slots if s is not slot)]
        keep_it = _Keep(arena, document, timeline, crcs)
        self._enqueue(_Cycle(step, slot, layout, None, {}, time.perf_counter(), keep=keep_it))

    def complete_slots(self) -> list[Slot]:
        """The complete own slots, newest step first."""
        done = [s for s in self.slots if s.complete and s.step is not None]
        return sorted(done, key=lambda s: s.step or 0, reverse=True)

    @property
    def failure(self) -> CaptureError | None:
        """The error every call raises once the worker thread has stopped (else ``None``)."""
        death = self._death
        if death is None and not self._worker.is_alive() and not self._closed:
            death = RuntimeError("the capture worker thread is gone")
        if death is None:
            return None
        err = CaptureError(
            f"rank {self.rank}: the capture worker stopped on {death!r}; no capture can "
            "complete in this process any more; fix the cause and restart the process "
            "(slots it committed before stay for recovery)"
        )
        err.__cause__ = death
        return err

    def close(self) -> None:
        """Finish the in-flight cycle, stop the worker and free every arena.

        Raises the worker's error (:attr:`failure`) after freeing everything when
        the worker had stopped.
        """
        if self._closed:
            return
        try:
            self._finish_previous(raise_errors=False, resolve=False)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify()
            self._worker.join(timeout=60)
            for s in self.slots:
                s.free()
        if self._death is not None:
            self._raise_if_dead()

    # ----------------------------------------------------------------- internals
    def _enqueue(self, cycle: _Cycle) -> None:
        with self._cv:
            self._raise_if_dead()
            self._cycle = cycle
            self._jobs.append(cycle)
            self._cv.notify()

    def _finish_previous(self, raise_errors: bool = True, resolve: bool = True) -> None:
        cycle = self._cycle
        if cycle is not None:
            gate = cycle.gate
            if gate is not None and not gate.decided:
                if resolve:
                    gate.resolve()  # the verdict's owner decides now (never waits on nobody)
                else:
                    gate.decide(False, "closed before the verdict")
            self._wait_for(cycle.finished)
        if raise_errors:
            self._raise_pending()
            self._raise_if_dead()

    def _wait_for(self, event: threading.Event) -> None:
        """Wait for a cycle's ``event``, or until the worker that would set it is gone."""
        while not event.wait(CAPTURE_WORKER_POLL_S):
            if not self._worker.is_alive():
                return

    def _raise_if_dead(self) -> None:
        err = self.failure
        if err is not None:
            raise err

    def _raise_pending(self) -> None:
        err = self._pending_error
        if err is not None:
            self._pending_error = None
            raise err

    def _layout_for(self, encoded: EncodedState, persisted: bool) -> Layout:
        key = (Layout.signature(encoded.tensors), tuple(encoded.names))
        if self._layout is None or key != self._layout_key:
            new = Layout.from_tensors(encoded.tensors, encoded.names)
            if persisted and self._check_layout is not None:
                # A state tree may be written to a shard: refuse dtypes the format cannot
                # store here, on the caller's thread, not at every later flush. Only when
                # the layout is rebuilt.
                self._check_layout(new)
            if self._layout is not None:
                self.stats.relayouts += 1
                log.info(
                    "rank %d: state structure changed (%d -> %d tensors, %d -> %d bytes); "
                    "rebuilding the layout and reallocating slots as they are reused",
                    self.rank,
                    len(self._layout.specs),
                    len(new.specs),
                    self._layout.total_bytes,
                    new.total_bytes,
                )
            if self._plan_arenas is not None:
                self._plan_arenas(new.total_bytes)
            self._layout, self._layout_key = new, key
            self._devices = {t.device for t in encoded.tensors if t.device.type == "cuda"}
        return self._layout

    def _rotate(self) -> Slot:
        """Make the oldest slot the new ``own_current`` target; keeps every complete newer one."""
        cur = self.slots[0]
        if cur.complete:
            # Newest complete capture becomes own_previous; the oldest buffer is reused.
            self.slots = [self.slots[-1], *self.slots[:-1]]
        return self.slots[0]

    @staticmethod
    def _record_ready(tensors: list[torch.Tensor]) -> dict[torch.device, Any]:
        if not _CUDA:  # no device tensors can exist: skip the per-tensor scan
            return {}
        return CaptureEngine._record_ready_on({t.device for t in tensors})

    @staticmethod
    def _record_ready_on(devices: set[torch.device]) -> dict[torch.device, Any]:
        ready: dict[torch.device, Any] = {}
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                ready[device] = event
        return ready

    def _finish_encoding(self, cycle: _Cycle) -> tuple[Layout, EncodedState]:
        """Worker: walk the deferred parts and lay them out (the caller's thread did the rest)."""
        assert cycle.partial is not None
        encoded = cycle.partial.finish()
        cycle.partial = None
        layout = self._layout_for(encoded, persisted=True)
        for device in {t.device for t in encoded.tensors if t.device.type == "cuda"}:
            if device not in cycle.ready:
                # A device the previous layout did not use: no event was recorded on its
                # stream at the boundary, so wait for everything queued on it instead.
                torch.cuda.synchronize(device)
        cycle.layout, cycle.encoded = layout, encoded
        return layout, encoded

    def _launch_device(
        self, cycle: _Cycle, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[Any]:
        """Enqueue device->host copies on one side stream per device; returns their events."""
        done = []
        for device, ready in cycle.ready.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                mine = [(d, s) for d, s in pairs if s.device == device]
                if mine:
                    torch._foreach_copy_(
                        [d for d, _ in mine], [s for _, s in mine], non_blocking=True
                    )
                event = torch.cuda.Event()
                event.record(stream)
            done.append(event)
        return done

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._jobs or self._closed)
                    if not self._jobs:
                        return
                    cycle = self._running = self._jobs.pop(0)
                if self._spare is None:  # before this cycle finishes: see _take_events
                    self._spare = (threading.Event(), threading.Event())
                if cycle.keep is not None:
                    self._run_keep(cycle, cycle.keep)
                else:
                    self._run_cycle(cycle)
                self._running = None
        except BaseException as exc:  # the thread ends: nobody may be left waiting on it
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Worker, last act: record why it stops and release every waiter."""
        with self._cv:
            self._death = exc
            cycles = [c for c in (self._running, *self._jobs) if c is not None]
            self._jobs.clear()
        log.error("rank %d: the capture worker stopped: %r", self.rank, exc)
        for cycle in cycles:  # their slots stay COPYING (files WRITING): never selected
            self.stats.failures += 1
            cycle.captured.set()
            cycle.finished.set()

    @torch.no_grad()
    def _run_cycle(self, cycle: _Cycle) -> None:
        # no_grad: copying a parameter that requires grad must not record autograd history.
        slot = cycle.slot
        if cycle.partial is not None:
            try:
                layout, encoded = self._finish_encoding(cycle)
            except BaseException as exc:  # raised as it is on the caller's next call
                add_note(
                    exc, f"(rank {self.rank}: while encoding the capture of step {cycle.step})"
                )
                self._fail(cycle, exc)
                return
        else:
            assert cycle.layout is not None and cycle.encoded is not None
            layout, encoded = cycle.layout, cycle.encoded
        try:
            t0 = time.perf_counter()
            if slot.prepare(layout, pin=self.pin_memory):
                self.stats.allocations += 1
            self._copy_pairs(cycle, list(zip(slot.views(), encoded.tensors, strict=True)))
            self.stats.copy_s.append(time.perf_counter() - t0)
            if cycle.gate is not None and not self._await_gate(cycle, cycle.gate):
                return
            slot.publish(cycle.step, encoded.document, self.rank)
            # wait_captured() may return now: the sources may change, the arena is ours.
            cycle.captured.set()
            assert slot.arena is not None
            if self.checksums:
                t1 = time.perf_counter()
                slot.seal(arena_crcs(slot.arena))
                self.stats.crc_s.append(time.perf_counter() - t1)
            else:
                slot.seal(None)
        except BaseException as exc:  # recorded and raised on the caller's next call
            if isinstance(exc, CaptureError):  # already says what failed (MemoryFolderFull)
                add_note(exc, f"(rank {self.rank}: capture of step {cycle.step})")
                err: BaseException = exc
            else:
                err = CaptureError(
                    f"rank {self.rank}: capture of step {cycle.step} failed: {exc!r}"
                )
                err.__cause__ = exc
            self._fail(cycle, err)
            return
        try:
            if self.after_capture is not None:
                self.after_capture(slot)
        except BaseException as exc:
            err = CaptureError(
                f"rank {self.rank}: follow-up of captured step {cycle.step} failed: {exc!r}"
            )
            err.__cause__ = exc
            self._pending_error = err
        finally:
            cycle.captured.set()
            cycle.finished.set()

    def _await_gate(self, cycle: _Cycle, gate: CommitGate) -> bool:
        """Worker: release the caller, wait for the verdict; False: the capture is dropped."""
        cycle.captured.set()  # the bytes are ours: the sources may change
        while not gate.wait(CAPTURE_WORKER_POLL_S):
            if self._closed:
                gate.decide(False, "closed before the verdict")
        if gate.accepted:
            return True
        cycle.slot.invalidate()  # never published: recovery never saw it
        self.stats.discarded += 1
        log.info(
            "rank %d: capture of step %d discarded before its commit (%s)",
            self.rank,
            cycle.step,
            gate.reason or "verdict refused it",
        )
        cycle.finished.set()
        return False

    def _run_keep(self, cycle: _Cycle, keep: _Keep) -> None:
        """Worker: copy a handed-over arena into ``cycle.slot`` and commit it as recorded."""
        slot = cycle.slot
        assert cycle.layout is not None and keep.source is not None
        try:
            t0 = time.perf_counter()
            if slot.prepare(cycle.layout, pin=self.pin_memory):
                self.stats.allocations += 1
            assert slot.arena is not None
            self._copy_host([(slot.arena, keep.source)])
            keep.source = None  # the live state keeps the handed-over arena alive, not us
            self.stats.kept_copy_s.append(time.perf_counter() - t0)
            cycle.captured.set()  # the live state may change now: the copy is ours
            crcs = arena_crcs(slot.arena)
            if keep.crcs is not None and crcs != keep.crcs:
                log.warning(
                    "rank %d: the recovered state of step %d changed before commit_restore(); "
                    "it is not kept in own memory (its peer's replica and disk still hold it)",
                    self.rank,
                    cycle.step,
                )
                slot.invalidate()
            else:
                slot.timeline = keep.timeline
                slot.publish(cycle.step, keep.document, self.rank, crcs=crcs)
        except BaseException as exc:  # recorded and raised on the caller's next call
            what = f"keeping recovered step {cycle.step} in own memory"
            if isinstance(exc, CaptureError):  # already says what failed (MemoryFolderFull)
                add_note(exc, f"(rank {self.rank}: {what})")
                err: BaseException = exc
            else:
                err = CaptureError(f"rank {self.rank}: {what} failed: {exc!r}")
                err.__cause__ = exc
            self._fail(cycle, err)
            return
        cycle.captured.set()
        cycle.finished.set()

    def _fail(self, cycle: _Cycle, err: BaseException) -> None:
        """Worker: the cycle failed; its slot is never exposed, ``err`` is raised next call."""
        cycle.slot.invalidate()
        self.stats.failures += 1
        self._pending_error = err
        cycle.captured.set()
        cycle.finished.set()

    def _copy_pairs(self, cycle: _Cycle, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy ``pairs`` (arena view, source) and wait until every byte arrived."""
        if not cycle.ready:
            self._copy_host(pairs)
            return
        # Device copies are enqueued first; host copies overlap them.
        on_dev = [p for p in pairs if p[1].device.type == "cuda"]
        events = self._launch_device(cycle, on_dev)
        self._copy_host([p for p in pairs if p[1].device.type != "cuda"])
        for event in events:
            event.synchronize()

    def _copy_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        limit = self.rate_limit
        if limit is None:
            if pairs:  # one fused call: per-tensor dispatch dominates for many small tensors
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            return
        start = time.perf_counter()
        done = 0
        for dst, src in pairs:
            if not src.is_contiguous():
                dst.copy_(src)
                done += dst.numel() * dst.element_size()
                continue
            flat_dst, flat_src = dst.view(-1), src.view(-1)
            step = max(1, HOST_COPY_PIECE_BYTES // max(1, src.element_size()))
            for i in range(0, flat_src.numel(), step):
                flat_dst[i : i + step].copy_(flat_src[i : i + step])
                done += min(step, flat_src.numel() - i) * src.element_size()
                ahead = done / limit - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)

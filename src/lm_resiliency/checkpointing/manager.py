"""InMemoryCheckpointManager: capture -> replicate -> persist -> recover, for one rank.

Call order on every rank (the contract's training loop)::

    manager = InMemoryCheckpointManager(InMemoryCkptConfig(interval=10))
    for step in range(1, max_steps + 1):
        loss = train_step(); loss.backward()
        manager.maybe_wait()          # before the parameters are modified again
        optimizer.step(); optimizer.zero_grad()
        if step % manager.config.interval == 0:
            manager.save(state_dict(), step)
    manager.close()

and on recovery, on every rank: ``step = manager.find_latest()`` then
``state = manager.load(step)``, apply ``state``, then ``manager.commit_recovery()``
(``save`` and ``maybe_wait`` commit it too, at the latest).

Which calls are collective: the constructor (creates the control plane,
agrees the run id, topology fingerprint and timelines, connects the
replication edges), ``find_latest``, ``load`` and ``close`` run on every rank
of the group. ``save`` and ``maybe_wait`` are local; replication pairs ranks
in the background, so every rank must ``save`` the same steps (the contract
loop does).

With ``memory_folder`` set (the default, ``/dev/shm/lm-resiliency``) every
slot is a file on that memory filesystem: a process that crashes leaves its
committed slots behind, and the manager of the restarted (or replacement)
process on the same node re-attaches to them at construction, so recovery
comes from memory, not disk.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from lm_resiliency.capture.engine import Adopted, CaptureEngine, CaptureStats
from lm_resiliency.capture.slot import ANONYMOUS, ArenaBacking, Slot
from lm_resiliency.checkpointing.flush import DiskFlusher, ExitFlush, FlushStats, consistent_newest
from lm_resiliency.checkpointing.history import History
from lm_resiliency.checkpointing.peer import PeerReplicas, ReplicationStats
from lm_resiliency.checkpointing.restore import RecoveryReport, Restorer
from lm_resiliency.checkpointing.setup import describe_plan, disk_topologies, memory_tier, preflight
from lm_resiliency.checkpointing.trust_writer import TrustWriter
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.control import ControlPlane
from lm_resiliency.distributed import restart_count
from lm_resiliency.errors import CaptureError, ResiliencyError, UnsafePathError
from lm_resiliency.memory import MemoryTier
from lm_resiliency.persistence import (
    RecoveryVerdict,
    ShardStore,
    TrustStatus,
    agree_job_fingerprint,
    install_flush_on_signal,
    resolve_run_id,
    topology_fingerprint,
)
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.disk_lock import DiskLock
from lm_resiliency.persistence.lineage import Lineage
from lm_resiliency.recovery.availability import Report, Source
from lm_resiliency.recovery.fetch import FetchContext
from lm_resiliency.recovery.mode import RecoveryMode
from lm_resiliency.recovery.sources import DiskShards, MemorySlots, NoSource, StepSource
from lm_resiliency.replication import ReplicationChannel

log = logging.getLogger(__name__)

__all__ = ["InMemoryCheckpointManager", "RecoveryReport"]


class InMemoryCheckpointManager:
    """GEMINI for one rank. Not part of the stable API (see the README).

    ``group``: the ranks that checkpoint together (default: the world when a
    default process group exists; without one the manager is single-process).
    ``hsdp_replicated``: the caller's 2-D mesh already holds every shard on a
    replica rank; with ``skip_replication_if_hsdp`` no peer transfer happens
    and only the two own slots exist. ``replica_ranks`` (HSDP): the ranks of
    ``group`` holding byte-identical model and optimizer state to this one,
    this rank included, evenly spaced (the replicate dimension of a
    replicate-major mesh); a rank whose memory is lost is then restored from
    a replica's own slot. ``load_fallback``: called by ``load`` when no
    GEMINI step is available on every rank (the framework's durable checkpoint).
    """

    def __init__(
        self,
        config: InMemoryCkptConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        hsdp_replicated: bool = False,
        replica_ranks: Sequence[int] | None = None,
        load_fallback: Callable[[], Any] | None = None,
    ) -> None:
        self.config = cfg = config or InMemoryCkptConfig()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.group = (
            group if group is not None else (dist.group.WORLD if self._distributed else None)
        )
        self.load_fallback = load_fallback
        self.last_recovery: RecoveryReport | None = None
        self._closed = False
        self._verified: set[int] = set()
        # Certification by SCOUT (see certify/reject): memory now, disk in the background.
        self._candidates: set[int] = set()
        self._persist_requested: set[int] = set()
        self._verdict: RecoveryVerdict | None = None
        self._trust_lock = threading.Lock()
        self._last_capture: int | None = None
        self._handovers: list[Callable[[], object]] = []
        """Own-memory slots the last ``load`` used, handed over at ``commit_recovery``."""
        self._other_topologies: list[str] = []
        """Namespaces of this run for another topology (another world size or pairing)."""
        self.control = ControlPlane(self.group, timeout_s=cfg.control_timeout_s)
        self.rank = self.control.rank
        self._trust_writer = TrustWriter(self.rank)
        self.world_size = self.control.world_size
        self.hsdp = cfg.skip_replication_if_hsdp and hsdp_replicated
        self.plan = self.control.agree(
            lambda: preflight(
                cfg,
                rank=self.rank,
                world_size=self.world_size,
                hsdp=self.hsdp,
                replica_ranks=replica_ranks,
            ),
            "check this rank's environment",
        )
        with self.control.op("agree the run id"):
            self.run_id = resolve_run_id(cfg.run_id, group=self.control.group)
        if self.rank == 0:
            log.info("GEMINI replication: %s", describe_plan(self.plan, hsdp=self.hsdp))
        pairs = self.plan.table() if self.plan is not None else []
        group_fp = topology_fingerprint(list(range(self.world_size)), pairs)
        with self.control.op("agree the topology"):
            self.topology = agree_job_fingerprint(group_fp, group=self.control.group)
        self.tier = self.control.agree(
            lambda: (
                memory_tier(
                    cfg,
                    run_id=self.run_id,
                    topology=self.topology,
                    rank=self.rank,
                    peer_owner=None if self.hsdp else self._serves_owner(),
                    superseded=self._other_topologies,
                )
                if cfg.enable
                else None
            ),
            "open the memory folders",
        )
        backing: ArenaBacking = self.tier if self.tier is not None else ANONYMOUS
        channel = None
        if self.plan is not None and self.plan.has_peer and cfg.enable:
            channel = ReplicationChannel(
                self.plan,
                run_id=self.run_id,
                rank=self.rank,
                chunk_bytes=cfg.replication_chunk_size,
                timeout_s=cfg.replication_timeout_s,
            )
        self._channel = channel
        self._peer: PeerReplicas | None = None
        if channel is not None and self.plan is not None and not self.hsdp:
            self._peer = PeerReplicas(
                channel,
                self.plan,
                rank=self.rank,
                run_id=self.run_id,
                pin_memory=cfg.pin_memory,
                backing=backing,
            )
        self._store: ShardStore | None = None
        self._disk_lock: DiskLock | None = None
        self._store_lock = threading.Lock()
        self._flusher = DiskFlusher(self.store, trust=self._trust)
        self._engine = CaptureEngine(
            rank=self.rank,
            pin_memory=cfg.pin_memory,
            rate_limit_bytes_per_s=cfg.copy_rate_limit_bytes_per_s,
            after_capture=self._after_capture,
            backing=backing,
            plan_arenas=self.tier.plan if self.tier is not None else None,
        )
        local = self.control.agree(
            self._open_local, "attach memory slots and open node-local folders"
        )
        self.history = History.agree(
            local, control=self.control, run_id=self.run_id, resume=cfg.resume
        )
        if self.tier is not None:
            tier = self.tier
            self.history.add_publisher(lambda lin, tl: self._publish_memory(tier, lin, tl))
        if self._store is not None:
            opened = self._store
            self.history.add_publisher(opened.set_lineage)
        self._restorer = Restorer(
            control=self.control,
            report=self._report,
            context=self._fetch_context,
            holder_of=self._holder_of,
            restarted=(restart_count() or 0) > 0,
            other_topologies=self._other_topologies
            + disk_topologies(cfg.disk_folder, self.run_id, self.topology),
        )
        self._exit_flush = ExitFlush(
            self._flush_consistent, deadline_s=cfg.signal_flush_deadline_s, after=self._after_flush
        )
        # A process that ends without close() (a survivor leaving on its collective error)
        # must stop our background threads before the interpreter tears torch down, or the
        # C++ runtime aborts the exit; the memory slots stay for the restarted worker.
        atexit.register(self._stop_threads)
        self._signal = None
        self._excepthook: Any = None
        if cfg.enable and cfg.signal_flush:
            if threading.current_thread() is threading.main_thread():
                self._signal = install_flush_on_signal(
                    self._exit_flush.run,
                    deadline_s=cfg.signal_flush_deadline_s,
                    busy=self._exit_flush.busy_on_main_thread,
                )
                self._install_excepthook()
            else:
                log.info("manager built off the main thread: no SIGTERM/SIGINT flush installed")

    # ------------------------------------------------------------------ construction
    def _open_local(self) -> list[Lineage | None]:
        self._attach()
        return self._local_lineages()

    def _attach(self) -> None:
        """Re-attach to the committed slots an earlier process of this rank left on this node."""
        if self.tier is None:
            return
        attached, problems = self.tier.attach(pin=self.config.pin_memory)
        for line in problems:
            if "(not_committed)" in line:  # the previous process died mid-capture: routine
                log.info("rank %d: not using a capture the previous process left half-written "
                         "(%s)", self.rank, line)  # fmt: skip
            else:
                log.warning("rank %d: ignoring %s", self.rank, line)
        own: list[Adopted] = []
        held: list[Adopted] = []
        for a, handle in attached:
            r = a.record
            adopted = Adopted(a.slot_name, handle, r.layout, r.step, r.state, r.timeline, r.crcs)
            (own if r.identity.role == "own" else held).append(adopted)
        self._engine.adopt(own)
        if self._peer is not None:
            self._peer.adopt(held)
        else:
            for h in held:
                h.handle.release()
        if attached:
            log.info(
                "rank %d: re-attached memory slots: own %s, held %s",
                self.rank,
                sorted(a.step for a in own),
                sorted(a.step for a in held),
            )

    def _local_lineages(self) -> list[Lineage | None]:
        found: list[Lineage | None] = []
        if self.tier is not None:
            found.append(self.tier.folder.read_lineage())
        if self._run_on_disk():
            found.append(self.store().read_lineage())  # takes the disk lock: refused if live
        return found

    def _run_on_disk(self) -> bool:
        """Whether this run's namespace exists in ``disk_folder`` (never created to look)."""
        return (Path(self.config.disk_folder) / ns.run_dir(self.run_id)).is_dir()

    @staticmethod
    def _publish_memory(tier: MemoryTier, lineage: Lineage, timeline: str) -> None:
        tier.timeline = timeline
        if tier.folder.dir_fd is not None:
            tier.folder.write_lineage(lineage)

    # ------------------------------------------------------------------ capture
    def save(self, state: Any, step: int) -> None:
        """Launch an asynchronous capture of ``state`` (a state tree) at optimizer ``step``.

        Returns after launching the copy; the cost does not grow with the state's
        bytes. Call :meth:`maybe_wait` before modifying the captured tensors again.
        Waits for the previous capture cycle (copy and replication) first.
        Raises ``StateEncodingError`` (unsupported value, with its key path),
        ``MemoryFolderFull`` (``memory_required`` and the memory folder has no
        room) and ``CaptureError`` (an earlier background failure, with its step).
        """
        self._check_open()
        if not self.config.enable:
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (the optimizer step)")
        self.commit_recovery()  # training went on: the recovered state was applied
        self.history.commit(None, None)  # no recovery decided before: this is a fresh timeline
        self._engine.capture(state, step)

    def maybe_wait(self) -> None:
        """Wait until the in-flight capture is complete and its replication launched.

        Call before ``optimizer.step()`` (or any change to captured tensors).
        Returns at once when no capture is in flight. Raises ``CaptureError``
        for a failed background capture.
        """
        self._check_open()
        self.commit_recovery()  # before the optimizer changes what load() returned
        self._engine.wait_captured()

    def _after_capture(self, slot: Slot) -> None:
        """Completion worker: replicate the fresh capture, then schedule its flush."""
        if self._peer is not None:
            self._peer.replicate(slot)
        step = slot.step
        if step is None:
            return
        previous = self._last_capture
        self._last_capture = step
        if self._flush_due(step, previous):
            self._flusher.submit(self._slots_at(step))
        with self._trust_lock:
            requested = step in self._persist_requested
        if requested:
            self._flusher.submit(self._slots_at(step))  # a repeat of a due flush is a no-op

    def _flush_due(self, step: int, previous: int | None) -> bool:
        """A capture is persisted when a multiple of ``disk_flush_interval`` lies in
        (previous capture, this capture]: interval 5 and flush 10 persist 10, 20, 30..."""
        every = self.config.disk_flush_interval
        if not every:
            return False
        before = previous if previous is not None else step - self.config.interval
        return step // every > max(before, -1) // every

    def _slots_at(self, step: int) -> list[Slot]:
        slots = [s for s in self._engine.complete_slots() if s.step == step]
        if self._peer is not None:
            slots += [s for s in self._peer.complete_slots() if s.step == step]
        return slots

    def flush_newest(self) -> list[int]:
        """Synchronously persist a consistent set of slots (the signal and exit path).

        What is written: the newest step for which this rank holds both its own
        slot and its peer's replica, then a newer own slot if there is one (see
        ``consistent_newest``). One flush runs at a time; a call while one is
        running (another thread, or the SIGTERM handler) joins it. Returns the
        steps written.
        """
        return self._exit_flush.run()

    def _flush_consistent(self) -> list[int]:
        held = self._peer.complete_slots() if self._peer is not None else []
        chosen = consistent_newest(self._engine.complete_slots(), held)
        written = self._flusher.flush_newest(chosen, self.config.signal_flush_deadline_s)
        log.info("rank %d: flushed steps %s to %s", self.rank, written, self.config.disk_folder)
        return written

    def _after_flush(self, owner: threading.Thread) -> None:
        if self._signal is not None and owner is threading.main_thread():
            self._signal.release_pending()

    def _install_excepthook(self) -> None:
        """An uncaught exception (a survivor's collective error) flushes slots that would die."""
        previous = sys.excepthook

        def hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            if not self._closed and not self.survives_process:
                log.warning(
                    "rank %d: exiting on %s; persisting the newest slots first (they live in "
                    "process memory)",
                    self.rank,
                    exc_type.__name__,
                )
                try:
                    self._exit_flush.run()
                except Exception as err:  # the original error is what the user must see
                    log.warning("rank %d: exit flush failed: %s", self.rank, err)
            previous(exc_type, exc, tb)

        self._excepthook = (hook, previous)
        sys.excepthook = hook

    def _stop_threads(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flusher.close()
        try:
            self._engine.close()
        except CaptureError as exc:  # at exit: say it, and still release the folder
            log.error("rank %d: %s", self.rank, exc)
        if self.tier is not None:
            self.tier.close(remove=False)
        if self._disk_lock is not None:
            self._disk_lock.release()

    @property
    def survives_process(self) -> bool:
        """Whether the in-memory slots outlive this process (on the memory filesystem)."""
        return self.tier is not None and self.tier.survives_process

    def wait_persisted(self, timeout_s: float | None = None) -> bool:
        """Block until every scheduled node-local write finished (for tests and shutdown)."""
        self._engine.wait_idle()
        return self._flusher.wait_idle(timeout_s) and self.wait_trust(timeout_s)

    # ------------------------------------------------------------------ persistence
    def store(self) -> ShardStore:
        """This rank's node-local shard store (created on first use).

        Creating it takes this rank's disk lock of the run (``live-rank-<R>.lock`` in
        the run's folder, see :mod:`lm_resiliency.persistence.disk_lock`); raises
        ``ResiliencyError`` naming the other job when a live one holds it.
        """
        with self._store_lock:
            if self._store is None:
                store = ShardStore(
                    self.config.disk_folder,
                    run_id=self.run_id,
                    topology=self.topology,
                    rank=self.rank,
                    verify_integrity=self.config.verify_integrity,
                    keep_generations=self.config.keep_generations,
                )
                try:
                    self._disk_lock = DiskLock.take(store.root, run_id=self.run_id, rank=self.rank)
                except BaseException:
                    store.close()
                    raise
                self._store = store
                history = getattr(self, "history", None)
                if history is not None:
                    store = self._store
                    history.add_publisher(store.set_lineage)
            return self._store

    def _disk_store(self) -> ShardStore | None:
        # Files can only exist where the run's folder does; never create it just to look.
        if self._store is not None or self._run_on_disk():
            return self.store()
        return None

    def _trust(self, step: int) -> TrustStatus:
        if step in self._verified:
            return TrustStatus.RECOVERY_VERIFIED
        return TrustStatus.CANDIDATE if step in self._candidates else TrustStatus.UNVERIFIED

    def mark_verified(self, step: int) -> None:
        """Record ``step`` as recovery-verified (normally SCOUT certification does this)."""
        self._verified.add(step)
        held = self._serves_owner()
        self.store().mark_verified(step, (self.rank,) if held is None else (self.rank, held))

    # ------------------------------------------------------------------ recovery
    def _serves_owner(self) -> int | None:
        """The rank whose state this rank can serve (its replica's owner, or its HSDP partner)."""
        if self.plan is None or not self.plan.has_peer:
            return None
        return self.plan.recv_from(self.rank)

    def _sources(self) -> dict[Source, StepSource]:
        eligible = self.history.eligible

        def current(step: int, timeline: str | None) -> bool:
            return timeline is None or eligible(step, timeline)

        own_memory = MemorySlots(
            Source.OWN_MEMORY, self._engine.complete_slots, eligible=current, consumes=True
        )
        sources: dict[Source, StepSource] = {
            Source.OWN_MEMORY: own_memory,
            Source.OWN_DISK: DiskShards(
                Source.OWN_DISK, self._disk_store, self.rank, eligible=eligible, streamed=False
            ),
            Source.PEER_MEMORY: NoSource(Source.PEER_MEMORY),
            Source.PEER_DISK: NoSource(Source.PEER_DISK),
        }
        owner = self._serves_owner()
        if owner is not None:
            if self._peer is not None:
                sources[Source.PEER_MEMORY] = MemorySlots(
                    Source.PEER_MEMORY, self._peer.complete_slots, eligible=current, consumes=False
                )
            elif self.hsdp:  # a replica's own slot holds the identical shard
                sources[Source.PEER_MEMORY] = MemorySlots(
                    Source.PEER_MEMORY,
                    self._engine.complete_slots,
                    eligible=current,
                    consumes=False,
                )
            disk_owner = self.rank if self.hsdp else owner
            sources[Source.PEER_DISK] = DiskShards(
                Source.PEER_DISK, self._disk_store, disk_owner, eligible=eligible, streamed=True
            )
        return sources

    def _report(self) -> Report:
        self._engine.wait_idle()
        self._flusher.wait_idle()
        src = self._sources()
        verified = set(self._verified)
        store = self._disk_store()
        if store is not None:
            status = store.status()
            verified |= set(status.verified_history)
            if status.verified_step is not None:
                verified.add(status.verified_step)
        return Report(
            src[Source.OWN_MEMORY].steps(),
            src[Source.OWN_DISK].steps(),
            src[Source.PEER_MEMORY].steps(),
            src[Source.PEER_DISK].steps(),
            frozenset(verified),
        )

    def _holder_of(self, rank: int) -> int | None:
        if self.plan is None or not self.plan.has_peer:
            return None
        return self.plan.send_to(rank)

    def _fetch_context(self) -> FetchContext:
        return FetchContext(
            rank=self.rank,
            world_size=self.world_size,
            control=self.control,
            run_id=self.run_id,
            plan=self.plan,
            channel=self._channel,
            sources=self._sources(),
        )

    def find_latest(self, mode: RecoveryMode = RecoveryMode.LATEST) -> int | None:
        """Collective: the newest step every rank can obtain, or ``None``.

        Each rank reports its own memory slots (re-attached from an earlier
        process too), its own node-local files and what it can serve its peer
        (memory and disk); a newer step present on only part of the job is
        never chosen, and neither is a generation of a timeline this job does
        not continue. ``RECOVERY_VERIFIED`` restricts the choice to steps every
        rank recorded as verified.
        """
        self._check_open()
        return self._restorer.newest(RecoveryMode(mode))

    def load(self, step: int | None = None, *, mode: RecoveryMode = RecoveryMode.LATEST) -> Any:
        """Collective: this rank's state tree at ``step`` (default: the newest common one).

        Each rank obtains its state from its cheapest source; a source that
        fails validation (checksum, schema, decode, identity, transfer) makes
        that rank try its next source for the same step before the job walks
        back to an older common step (LATEST) or fails closed
        (RECOVERY_VERIFIED). Every check happens before the ranks agree, so a
        step is returned on every rank or on none. Without any GEMINI step,
        ``load_fallback()`` is returned when given. Tensors are CPU tensors,
        bit-identical to the captured ones, owned by the caller.
        ``last_recovery`` then says which step and sources were used. Raises
        ``NoConsistentStep``.

        Restoring from own memory copies nothing: the returned tensors are
        views of the slot's arena. The slot is handed over (it leaves the memory
        folder and is empty until the next capture; the step stays recoverable
        from the peer's replica and from disk where persisted) only at
        :meth:`commit_recovery`, which ``save`` and ``maybe_wait`` call too.
        Until then it stays committed: a process that dies while applying the
        state (or that raises first) leaves it for the restarted process.
        """
        self._check_open()
        outcome = self._restorer.load(step, RecoveryMode(mode), self.load_fallback)
        if outcome.fetched is not None and outcome.fetched.consume is not None:
            self._handovers.append(outcome.fetched.consume)
        self.last_recovery = outcome.report
        chosen = outcome.report.step
        fresh = self._last_capture is None  # nothing written under this timeline yet
        if chosen is None:
            self.history.commit(None, None, replace=fresh)
        else:
            parent = self._timeline_of(chosen)
            self.history.commit(parent, chosen, replace=fresh)
        return outcome.state

    def commit_recovery(self) -> None:
        """Local: the state of the last ``load`` is applied; hand its own-memory slot over.

        Call after the recovered state is in the model and optimizer (the front
        door calls it once the adapter applied it; ``save`` and ``maybe_wait``
        call it too). Idempotent; does nothing when ``load`` used no own slot.
        """
        handovers, self._handovers = self._handovers, []
        for consume in handovers:
            with contextlib.suppress(LookupError):  # already taken, or dropped since
                consume()

    def _timeline_of(self, step: int) -> str | None:
        """The timeline of the recovered step (agreed: rank 0's view of its generation)."""
        mine = None
        for slot in self._engine.slots + (self._peer.slots if self._peer is not None else []):
            if slot.step == step and slot.timeline is not None:
                mine = slot.timeline
        store = self._disk_store()
        if mine is None and store is not None:
            mine = store.timeline_of(self.rank, step)
        if mine is None:
            mine = self.history.lineage.head.id if self.history.lineage.head else ""
        gathered = self.control.all_gather_bytes(mine.encode(), name="agree the recovered timeline")
        chosen = next((g.decode() for g in gathered if g), "")
        return chosen or None

    def drop_memory(self) -> None:
        """Lose every in-memory slot, files included, as a replacement node would (drills)."""
        self._engine.wait_idle()
        self._flusher.wait_idle()
        for s in self._engine.slots:
            s.discard()
        if self._peer is not None:
            for s in self._peer.slots:
                s.discard()

    # ------------------------------------------------------------------ lifecycle
    @property
    def stats(self) -> CaptureStats:
        """Capture timings and counts (blocking time = save_s + wait_s)."""
        return self._engine.stats

    @property
    def replication_stats(self) -> ReplicationStats | None:
        return self._peer.stats if self._peer is not None else None

    @property
    def flush_stats(self) -> FlushStats:
        return self._flusher.stats

    def slots(self) -> dict[str, Slot]:
        """The slots by contract role name (for tests, logs and the inspect tooling)."""
        roles = {"own_current": self._engine.current}
        prev = self._engine.previous
        if prev is not None:
            roles["own_previous"] = prev
        if self._peer is not None:
            roles["peer_current"] = self._peer.current
            roles["peer_previous"] = self._peer.previous
        return roles

    def arena_bytes(self) -> int:
        """Host bytes held by all slots' arenas."""
        return sum(s.arena_bytes for s in self.slots().values())

    def finish(self) -> None:
        """Mark the run finished (its last step is done); ``close()`` does it by default.

        A later launch with the same run id and folders does not resume a
        finished run unless ``resume="finished"``.
        """
        self._check_open()
        self.history.finish(self._last_capture)

    def close(self, *, finished: bool = True) -> None:
        """Finish in-flight work, optionally flush, stop the workers, free every arena.

        ``finished=True`` (a normal end of training, the default) marks the run
        finished and removes its memory slots (unless ``keep_memory_on_close``);
        ``finished=False`` (leaving on an error, or to continue later) keeps
        them for a restarted process. The context manager passes
        ``finished=False`` when an exception leaves the block.
        """
        if self._closed:
            return
        try:
            self._engine.wait_idle()
        except ResiliencyError as exc:
            log.warning("rank %d: closing after a failed capture: %s", self.rank, exc)
            finished = False
        if self.config.flush_on_close:
            self.flush_newest()
        self._flusher.wait_idle()
        if finished and self.config.enable:
            try:
                self.history.finish(self._last_capture)
            except (OSError, UnsafePathError) as exc:
                log.warning("rank %d: could not mark the run finished: %s", self.rank, exc)
        self._closed = True
        atexit.unregister(self._stop_threads)
        self._flusher.close()
        if self._signal is not None:
            self._signal.uninstall()
        if self._excepthook is not None and sys.excepthook is self._excepthook[0]:
            sys.excepthook = self._excepthook[1]
        died: CaptureError | None = None
        try:
            self._engine.close()
        except CaptureError as exc:  # the worker had stopped: raised once all is released
            died = exc
        if self._peer is not None:
            self._peer.close()
        elif self._channel is not None:
            self._channel.close()
        if self.tier is not None:
            self.tier.close(remove=finished and not self.config.keep_memory_on_close)
        self._trust_writer.close()
        if self._store is not None:
            self._store.close()
        if self._disk_lock is not None:
            self._disk_lock.release()
        self.control.close()
        if died is not None:
            raise died

    def _check_open(self) -> None:
        if self._closed:
            raise ResiliencyError("this InMemoryCheckpointManager is closed; create a new one")

    def __enter__(self) -> InMemoryCheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(finished=exc_type is None)

    # ------------------------------------------------------------------ certification (SCOUT)
    def certify(self, step: int, trust: TrustStatus, *, persist: bool = True) -> None:
        """Record the capture of ``step`` as ``trust`` (``CANDIDATE`` or ``RECOVERY_VERIFIED``).

        Local and non-blocking, callable from an optimizer hook: the in-memory record
        is immediate (``find_latest`` of this process sees it at once); the sidecar
        update and, with ``persist``, the node-local write of the step's own slot and
        the peer replica this rank holds (with ``trust`` in their headers) run in the
        background. A capture still in flight is written once it and its replication
        complete. Promoting a candidate to ``RECOVERY_VERIFIED`` needs no ``persist``
        (its files exist). Raises ``ValueError`` for another trust or a bad step.
        """
        self._check_open()
        trust = TrustStatus(trust)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (a captured step)")
        if trust is TrustStatus.UNVERIFIED:
            raise ValueError("certify() records CANDIDATE or RECOVERY_VERIFIED, not UNVERIFIED")
        with self._trust_lock:
            if trust is TrustStatus.RECOVERY_VERIFIED:
                self._verified.add(step)
                self._candidates.discard(step)
            else:
                self._candidates.add(step)
            if persist:
                self._persist_requested.add(step)
        if persist:
            # Complete slots are queued now; a capture still in flight is queued by
            # _after_capture once it (and its replication) is complete.
            self._flusher.submit(self._slots_at(step))
        if trust is TrustStatus.RECOVERY_VERIFIED:
            # mark_verified also publishes the trust markers next to the shards.
            self._in_background(lambda: self.mark_verified(step), f"verify step {step}")
        else:
            self._in_background(lambda: self.store().mark_candidate(step), f"candidate {step}")

    def reject(self, step: int, *, reason: str) -> None:
        """Record ``step`` as rejected (SCOUT found SDC before it was verified).

        Local and non-blocking: ``step`` leaves the candidate and verified records at
        once; the sidecar keeps ``(step, reason)`` (written in the background), which
        ``lm-resiliency inspect`` shows. A rejected step is never chosen by
        ``RECOVERY_VERIFIED`` recovery.
        """
        self._check_open()
        with self._trust_lock:
            self._verified.discard(step)
            self._candidates.discard(step)
        self._in_background(lambda: self.store().mark_rejected(step, reason), f"reject {step}")

    def require_verified_recovery(self, step: int, *, reason: str) -> None:
        """Persist SCOUT's verdict "SDC seen at ``step``: recover in verified mode".

        Local and non-blocking (the sidecar is written in the background). A job
        restarted on this folder finds it with :meth:`recovery_verdict`.
        """
        self._check_open()
        verdict = RecoveryVerdict(step=step, reason=reason)
        self._verdict = verdict
        self._in_background(lambda: self.store().set_verdict(verdict), f"verdict at {step}")

    def clear_recovery_verdict(self) -> None:
        """Remove a persisted recovery verdict (after a verified recovery was certified)."""
        self._check_open()
        had = self.recovery_verdict() is not None
        self._verdict = None
        if had:
            self._in_background(lambda: self.store().set_verdict(None), "clear verdict")

    def recovery_verdict(self) -> RecoveryVerdict | None:
        """This rank's recovery verdict: set in this process, or read from its own sidecar.

        Local; never creates the disk folder. ``None`` when no verdict was recorded.
        """
        if self._verdict is not None:
            return self._verdict
        self.wait_trust()
        store = self._disk_store()
        return None if store is None else store.status().verdict

    def wait_trust(self, timeout_s: float | None = None) -> bool:
        """Block until every background trust update so far is written; False on timeout."""
        return self._trust_writer.wait(timeout_s)

    def _in_background(self, job: Callable[[], object], what: str) -> None:
        self._trust_writer.submit(job, what)

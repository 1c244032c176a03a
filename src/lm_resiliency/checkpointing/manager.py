"""InMemoryCheckpointManager: capture -> replicate -> persist -> recover, for one rank.

Call order on every rank (the plain training loop of README.md, "The GEMINI manager")::

    manager = InMemoryCheckpointManager(InMemoryCkptConfig(interval=10))
    for step in range(1, max_steps + 1):
        loss = train_step(); loss.backward()
        manager.maybe_wait()          # before the parameters are modified again
        optimizer.step(); optimizer.zero_grad()
        if step % manager.config.interval == 0:
            manager.save(state_dict(), step)
    manager.close()

and on recovery, on every rank: ``step = manager.find_latest()`` then
``state = manager.load(step)``, apply ``state``, then ``manager.commit_restore()``
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

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lm_resiliency.capture.engine import CaptureEngine, CaptureStats
from lm_resiliency.capture.slot import ANONYMOUS, ArenaBacking, Slot
from lm_resiliency.capture.target import Target
from lm_resiliency.checkpointing.disk import LocalDisk
from lm_resiliency.checkpointing.exit import ExitGuard
from lm_resiliency.checkpointing.flush import DiskFlusher, FlushStats, flush_due
from lm_resiliency.checkpointing.history import History
from lm_resiliency.checkpointing.peer import ReplicationStats
from lm_resiliency.checkpointing.restore import Restorer, RestoreReport, SourceSet
from lm_resiliency.checkpointing.setup import (
    Parts,
    agree_identity,
    disk_topologies,
    memory_publisher,
    memory_tier,
    reattach,
    replicas,
)
from lm_resiliency.checkpointing.trust import TrustLedger
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.control import ControlPlane
from lm_resiliency.distributed import restart_count
from lm_resiliency.errors import ResiliencyError, UnsafePathError
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence.format import check_storable
from lm_resiliency.persistence.lineage import Lineage
from lm_resiliency.recovery.mode import RecoveryMode

log = logging.getLogger(__name__)

__all__ = ["InMemoryCheckpointManager", "RestoreReport"]


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
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None else (dist.group.WORLD if distributed else None)
        self.load_fallback = load_fallback
        self.last_restore: RestoreReport | None = None
        self._closed = False
        self._last_capture: int | None = None
        self._handovers: list[Callable[[], object]] = []  # of the last load: see commit_restore
        other_topologies: list[str] = []  # this run's namespaces for another world size or pairing
        self.control = control = ControlPlane(self.group, timeout_s=cfg.control_timeout_s)
        self.rank, self.world_size = rank, _world = control.rank, control.world_size
        self.hsdp = hsdp = cfg.skip_replication_if_hsdp and hsdp_replicated
        ident = agree_identity(control, cfg, hsdp=hsdp, replica_ranks=replica_ranks)
        self.plan, self.run_id, self.topology = ident.plan, ident.run_id, ident.topology
        self.namespace = space = ident.namespace  # topology, unless one of several groups
        plan, serves = ident.plan, ident.serves
        self.tier = control.agree(
            lambda: memory_tier(
                cfg,
                run_id=self.run_id,
                topology=space,
                rank=rank,
                peer_owner=None if hsdp else serves,
                superseded=other_topologies,
            ),
            "open the memory folders",
        )
        backing: ArenaBacking = self.tier if self.tier is not None else ANONYMOUS
        self._channel, self._peer = channel, peer = replicas(
            cfg, plan, run_id=self.run_id, rank=self.rank, hsdp=self.hsdp, backing=backing
        )
        self._disk = disk = LocalDisk(cfg, run_id=self.run_id, topology=space, rank=rank)
        # SCOUT's TrustSink (detection/certify.py) for this rank's captures:
        self.trust = trust = TrustLedger(rank, disk, serves_owner=serves, persist=self._persist)
        self._flusher = flusher = DiskFlusher(disk.store, trust=trust.trust_of)
        self._engine = engine = CaptureEngine(
            rank=self.rank,
            pin_memory=cfg.pin_memory,
            rate_limit_bytes_per_s=cfg.copy_rate_limit_bytes_per_s,
            after_capture=self._after_capture,
            backing=backing,
            plan_arenas=self.tier.plan if self.tier is not None else None,
            check_layout=check_storable,
        )
        local = control.agree(self._open_local, "attach memory slots and open node-local folders")
        self.history = history = History.agree(
            local, control=control, run_id=self.run_id, resume=cfg.resume
        )
        if self.tier is not None:
            history.add_publisher(memory_publisher(self.tier))
        disk.when_open(lambda store: history.add_publisher(store.set_lineage))
        parts = Parts(self.tier, channel, peer, disk, trust, flusher, engine)
        sources = SourceSet(
            parts, control=control, run_id=self.run_id, plan=plan, hsdp=hsdp, history=history
        )
        self._restorer = Restorer(
            sources,
            restarted=(restart_count() or 0) > 0,
            other_topologies=other_topologies
            + disk_topologies(cfg.disk_folder, self.run_id, space),
        )
        self._exit = ExitGuard(cfg, control, parts)

    # ------------------------------------------------------------------ construction
    def _open_local(self) -> list[Lineage | None]:
        """Re-attach this rank's memory slots; read the lineages this node keeps."""
        reattach(self.tier, self._engine, self._peer, rank=self.rank, pin=self.config.pin_memory)
        found: list[Lineage | None] = []
        if self.tier is not None:
            found.append(self.tier.folder.read_lineage())
        if self._disk.exists():
            found.append(self._disk.store().read_lineage())  # takes the disk lock: refused if live
        return found

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
        self.commit_restore()  # training went on: the recovered state was applied
        self.history.commit(None, None)  # no recovery decided before: this is a fresh timeline
        gate = self.trust.take_held(step)  # SCOUT's pipelined verdict: commit when decided
        if gate is None:
            self.trust.settle()  # an earlier step's verdict: decided before the next capture
        self._engine.capture(state, step, gate=gate)

    def maybe_wait(self) -> None:
        """Wait until the in-flight capture is complete and its replication launched.

        Call before ``optimizer.step()`` (or any change to captured tensors).
        Returns at once when no capture is in flight. Raises ``CaptureError``
        for a failed background capture.
        """
        self._check_open()
        self.commit_restore()  # before the optimizer changes what load() returned
        self._engine.wait_captured()
        self.trust.settle()  # a held capture's verdict (SCOUT, collective): commit or discard

    def _after_capture(self, slot: Slot) -> None:
        """Completion worker: replicate the fresh capture, then schedule its flush."""
        if self._peer is not None:
            self._peer.replicate(slot)
        step = slot.step
        if step is None:
            return
        previous = self._last_capture
        self._last_capture = step
        cfg = self.config
        if flush_due(step, previous, every=cfg.disk_flush_interval, interval=cfg.interval):
            self._persist(step)
        if self.trust.persist_requested(step):
            self._persist(step)  # a repeat of a due flush is a no-op

    def _persist(self, step: int) -> None:
        """Queue this rank's complete slots of ``step`` (own and held) for the node-local write."""
        slots = [s for s in self._engine.complete_slots() if s.step == step]
        if self._peer is not None:
            slots += [s for s in self._peer.complete_slots() if s.step == step]
        self._flusher.submit(slots)

    def flush_newest(self) -> list[int]:
        """Synchronously persist a consistent set of slots (the signal and exit path).

        What is written: the newest step for which this rank holds both its own
        slot and its peer's replica, then a newer own slot if there is one (see
        ``consistent_newest``). One flush runs at a time; a call while one is
        running (another thread, or the SIGTERM handler) joins it. Returns the
        steps written.
        """
        return self._exit.flush()

    @property
    def survives_process(self) -> bool:
        """Whether the in-memory slots outlive this process (on the memory filesystem)."""
        return self.tier is not None and self.tier.survives_process

    def wait_persisted(self, timeout_s: float | None = None) -> bool:
        """Block until every scheduled node-local write finished (for tests and shutdown)."""
        self._engine.wait_idle()
        return self._flusher.wait_idle(timeout_s) and self.trust.wait(timeout_s)

    def store(self) -> ShardStore:
        """This rank's node-local shard store (created on first use).

        Creating it takes this rank's disk lock of the run (``live-rank-<R>.lock`` in
        the run's folder, see :mod:`lm_resiliency.persistence.disk_lock`); raises
        ``ResiliencyError`` naming the other job when a live one holds it.
        """
        return self._disk.store()

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

    def load(
        self,
        step: int | None = None,
        *,
        mode: RecoveryMode = RecoveryMode.LATEST,
        into: Any = None,
    ) -> Any:
        """Collective: this rank's state tree at ``step`` (default: the newest common one).

        Each rank obtains its state from its cheapest source; a source that
        fails validation (checksum, schema, decode, identity, transfer) makes
        that rank try its next source for the same step before the job walks
        back to an older common step (LATEST) or fails closed
        (RECOVERY_VERIFIED). Every check happens before the ranks agree, so a
        step is returned on every rank or on none. Without any GEMINI step,
        ``load_fallback()`` is returned when given. Tensors are CPU tensors,
        bit-identical to the captured ones, owned by the caller.
        ``last_restore`` then says which step and sources were used. Raises
        ``NoConsistentStep``.

        Restoring from own memory copies nothing: the returned tensors are
        views of the slot's arena. The slot is handed over (its file leaves the
        memory folder; a fresh own copy of the step is committed there in the
        background, which ``maybe_wait`` waits for) only at
        :meth:`commit_restore`, which ``save`` and ``maybe_wait`` call too.
        Until then it stays committed: a process that dies while applying the
        state (or that raises first) leaves it for the restarted process.

        ``into``: a state tree of the same structure as the saved one whose tensors
        are the live, contiguous CPU model and optimizer tensors (e.g. the
        ``state_dict()`` trees). The step's bytes are then read, received or copied
        straight into them (memory already mapped: no page faults of fresh buffers),
        and the returned tree holds those very tensors (``last_restore.in_place``);
        an own-memory slot is copied, so it stays committed and is not handed over.
        Every check is the same; a source that fails one (a checksum included) may
        have written into them before the next source or step overwrites them, so
        after ``NoConsistentStep`` (or a ``load_fallback`` result) their bytes are
        garbage. A step whose layout differs from ``into``'s is returned as usual,
        in fresh tensors (a warning says so). Raises ``ValueError`` for a tensor of
        ``into`` that is not a contiguous CPU tensor.
        """
        self._check_open()
        target = Target.from_tree(into) if into is not None else None
        outcome = self._restorer.load(step, RecoveryMode(mode), self.load_fallback, target)
        if outcome.fetched is not None and outcome.fetched.consume is not None:
            self._handovers.append(outcome.fetched.consume)
        self.last_restore = outcome.report
        chosen = outcome.report.step
        fresh = self._last_capture is None  # nothing written under this timeline yet
        if chosen is None:
            self.history.commit(None, None, replace=fresh)
        else:
            parent = self._restorer.timeline_of(chosen)
            self.history.commit(parent, chosen, replace=fresh)
        return outcome.state

    def commit_restore(self) -> None:
        """Local: the state of the last ``load`` is applied; hand its own-memory slot over.

        Call after the recovered state is in the model and optimizer (the front
        door calls it once the adapter applied it; ``save`` and ``maybe_wait``
        call it too). Idempotent; does nothing when ``load`` used no own slot.
        With a memory folder the step is copied back into a fresh own slot in
        the background (no replication, no flush); ``maybe_wait`` waits for it.
        """
        handovers, self._handovers = self._handovers, []
        for consume in handovers:
            with contextlib.suppress(LookupError):  # already taken, or dropped since
                # Slots that outlive the process get a fresh own copy of the step (background).
                self._engine.hand_over(consume, keep=self.survives_process)

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
        if self._closed or self._exit.exited:
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
        self._exit.close(remove_memory=finished and not self.config.keep_memory_on_close)

    def _check_open(self) -> None:
        if self._closed or self._exit.exited:
            raise ResiliencyError("this InMemoryCheckpointManager is closed; create a new one")

    def __enter__(self) -> InMemoryCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(finished=exc[0] is None)  # an exception leaves the block: keep the slots

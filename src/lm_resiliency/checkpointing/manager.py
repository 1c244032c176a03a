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
``state = manager.load(step)``.

Which calls are collective: the constructor (agrees the run id and topology
fingerprint, connects the replication edges), ``find_latest``, ``load`` and
``close`` run on every rank of the group. ``save`` and ``maybe_wait`` are local;
replication pairs ranks in the background, so every rank must ``save`` the same
steps (the contract loop does).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from lm_resiliency.capture.engine import CaptureEngine, CaptureStats
from lm_resiliency.capture.slot import Slot
from lm_resiliency.checkpointing.flush import DiskFlusher, FlushStats
from lm_resiliency.checkpointing.peer import PeerReplicas, ReplicationStats
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import NoConsistentStep, ResiliencyError
from lm_resiliency.persistence import (
    RecoveryVerdict,
    ShardReader,
    ShardStore,
    TrustStatus,
    agree_job_fingerprint,
    install_flush_on_signal,
    resolve_run_id,
    topology_fingerprint,
)
from lm_resiliency.recovery.availability import (
    Report,
    Source,
    gather_reports,
    source_table,
)
from lm_resiliency.recovery.loader import FetchContext, Material, fetch_step
from lm_resiliency.recovery.mode import RecoveryMode
from lm_resiliency.replication import PairingPlan, ReplicationChannel, resolve_jump
from lm_resiliency.state import decode_state

log = logging.getLogger(__name__)

_OWN_STORAGE_BYTES = 1 << 20


@dataclass
class RecoveryReport:
    """What one ``load`` did: the step, each rank's source, bytes moved, time per phase."""

    step: int | None
    sources: list[str]
    bytes_moved: int
    walked_back_from: list[int] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)


class InMemoryCheckpointManager:
    """GEMINI for one rank. Not part of the stable API (see the README).

    ``group``: the ranks that checkpoint together (default: the world when a
    default process group exists; without one the manager is single-process).
    ``hsdp_replicated``: the caller's 2-D mesh already holds every shard on a
    replica rank; with ``skip_replication_if_hsdp`` no peer transfer happens
    and only the two own slots exist. ``load_fallback``: called by ``load`` when
    no GEMINI step is available on every rank (the framework's durable checkpoint).
    """

    def __init__(
        self,
        config: InMemoryCkptConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        hsdp_replicated: bool = False,
        load_fallback: Callable[[], Any] | None = None,
    ) -> None:
        self.config = cfg = config or InMemoryCkptConfig()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.group = (
            group if group is not None else (dist.group.WORLD if self._distributed else None)
        )
        self.rank = dist.get_rank(self.group) if self._distributed else 0
        self.world_size = dist.get_world_size(self.group) if self._distributed else 1
        self.load_fallback = load_fallback
        self.last_recovery: RecoveryReport | None = None
        self._closed = False
        self._verified: set[int] = set()
        # Certification by SCOUT (see certify/reject): memory now, disk in the background.
        self._candidates: set[int] = set()
        self._persist_requested: set[int] = set()
        self._verdict: RecoveryVerdict | None = None
        self._trust_jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmr-trust")
        self._trust_pending: list[Future[None]] = []
        self._trust_lock = threading.Lock()
        self._last_flushed: int | None = None
        self._pg = self.group if self._distributed else None
        self.run_id = resolve_run_id(cfg.run_id, group=self._pg)
        skip = cfg.skip_replication_if_hsdp and hsdp_replicated
        jump = None if skip else resolve_jump(cfg.replication_jump, self.world_size).jump
        self.plan: PairingPlan | None = (
            None if skip or jump is None else PairingPlan.build(self.world_size, jump)
        )
        if self.rank == 0:
            how = (
                "HSDP replicas (no transfer)"
                if skip
                else (self.plan.describe() if self.plan is not None else "no peer")
            )
            log.info("GEMINI replication: %s", how)
        pairs = self.plan.table() if self.plan is not None else []
        group_fp = topology_fingerprint(list(range(self.world_size)), pairs)
        self.topology = agree_job_fingerprint(group_fp, group=self._pg)
        self._peer: PeerReplicas | None = None
        if self.plan is not None and self.plan.has_peer and cfg.enable:
            channel = ReplicationChannel(
                self.plan,
                run_id=self.run_id,
                rank=self.rank,
                chunk_bytes=cfg.replication_chunk_size,
                timeout_s=cfg.replication_timeout_s,
            )
            self._peer = PeerReplicas(
                channel, self.plan, rank=self.rank, run_id=self.run_id, pin_memory=cfg.pin_memory
            )
        self._store: ShardStore | None = None
        self._store_lock = threading.Lock()
        self._flusher = DiskFlusher(self.store, trust=self._trust)
        self._engine = CaptureEngine(
            rank=self.rank,
            pin_memory=cfg.pin_memory,
            rate_limit_bytes_per_s=cfg.copy_rate_limit_bytes_per_s,
            after_capture=self._after_capture,
        )
        self._signal = None
        if cfg.enable and cfg.signal_flush:
            if threading.current_thread() is threading.main_thread():
                self._signal = install_flush_on_signal(
                    self.flush_newest, deadline_s=cfg.signal_flush_deadline_s
                )
            else:
                log.info("manager built off the main thread: no SIGTERM/SIGINT flush installed")

    # ------------------------------------------------------------------ capture
    def save(self, state: Any, step: int) -> None:
        """Launch an asynchronous capture of ``state`` (a state tree) at optimizer ``step``.

        Returns after launching the copy; the cost does not grow with the state's
        bytes. Call :meth:`maybe_wait` before modifying the captured tensors again.
        Waits for the previous capture cycle (copy and replication) first.
        Raises ``StateEncodingError`` (unsupported value, with its key path) and
        ``CaptureError`` (an earlier background failure, with its step).
        """
        self._check_open()
        if not self.config.enable:
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (the optimizer step)")
        self._engine.capture(state, step)

    def maybe_wait(self) -> None:
        """Wait until the in-flight capture is complete and its replication launched.

        Call before ``optimizer.step()`` (or any change to captured tensors).
        Returns at once when no capture is in flight. Raises ``CaptureError``
        for a failed background capture.
        """
        self._check_open()
        self._engine.wait_captured()

    def _after_capture(self, slot: Slot) -> None:
        """Completion worker: replicate the fresh capture, then schedule its flush."""
        if self._peer is not None:
            self._peer.replicate(slot)
        step = slot.step
        every = self.config.disk_flush_interval
        due = self._last_flushed is None or (step or 0) - self._last_flushed >= every
        if every and step is not None and due:
            self._last_flushed = step
            self._flusher.submit(self._slots_at(step))
        with self._trust_lock:
            requested = step in self._persist_requested
        if requested and step is not None:
            self._flusher.submit(self._slots_at(step))  # a repeat of a due flush is a no-op

    def _slots_at(self, step: int) -> list[Slot]:
        slots = [s for s in self._engine.complete_slots() if s.step == step]
        if self._peer is not None:
            slots += [s for s in self._peer.complete_slots() if s.step == step]
        return slots

    def flush_newest(self) -> list[int]:
        """Synchronously persist the newest complete own and peer slot (the signal path)."""
        newest = self._engine.complete_slots()[:1]
        if self._peer is not None:
            newest += self._peer.complete_slots()[:1]
        written = self._flusher.flush_newest(newest, self.config.signal_flush_deadline_s)
        log.info("rank %d: flushed steps %s to %s", self.rank, written, self.config.disk_folder)
        return written

    def wait_persisted(self, timeout_s: float | None = None) -> bool:
        """Block until every scheduled node-local write finished (for tests and shutdown)."""
        self._engine.wait_idle()
        return self._flusher.wait_idle(timeout_s) and self.wait_trust(timeout_s)

    # ------------------------------------------------------------------ persistence
    def store(self) -> ShardStore:
        """This rank's node-local shard store (created on first use)."""
        with self._store_lock:
            if self._store is None:
                self._store = ShardStore(
                    self.config.disk_folder,
                    run_id=self.run_id,
                    topology=self.topology,
                    rank=self.rank,
                    verify_integrity=self.config.verify_integrity,
                    keep_generations=self.config.keep_generations,
                )
            return self._store

    def _trust(self, step: int) -> TrustStatus:
        if step in self._verified:
            return TrustStatus.RECOVERY_VERIFIED
        return TrustStatus.CANDIDATE if step in self._candidates else TrustStatus.UNVERIFIED

    def mark_verified(self, step: int) -> None:
        """Record ``step`` as recovery-verified (normally SCOUT certification does this)."""
        self._verified.add(step)
        self.store().mark_verified(step)

    # ------------------------------------------------------------------ recovery
    def _report(self) -> Report:
        own_mem = {s.step for s in self._engine.complete_slots() if s.step is not None}
        held_mem: set[int] = set()
        if self._peer is not None:
            held_mem = {s.step for s in self._peer.complete_slots() if s.step is not None}
        own_disk: set[int] = set()
        held_disk: set[int] = set()
        verified = set(self._verified)
        # Files can only exist where the folder does; never create it just to look.
        if self._store is not None or Path(self.config.disk_folder).is_dir():
            store = self.store()
            own_disk = set(store.steps(self.rank))
            if self.plan is not None and self.plan.has_peer:
                held_disk = set(store.steps(self.plan.recv_from(self.rank)))
            status = store.status()
            verified |= set(status.verified_history)
            if status.verified_step is not None:
                verified.add(status.verified_step)
        return Report(
            frozenset(own_mem),
            frozenset(own_disk),
            frozenset(held_mem),
            frozenset(held_disk),
            frozenset(verified),
        )

    def _holder_of(self, rank: int) -> int | None:
        if self.plan is None or not self.plan.has_peer:
            return None
        return self.plan.send_to(rank)

    def _gather(self, mode: RecoveryMode) -> tuple[list[dict[int, Source]], set[int]]:
        self._engine.wait_idle()
        self._flusher.wait_idle()
        reports = gather_reports(self._report(), group=self._pg)
        table = source_table(reports, self._holder_of)
        common = set(table[0]).intersection(*table[1:]) if table else set()
        if mode is RecoveryMode.RECOVERY_VERIFIED:
            common = {s for s in common if all(s in r.verified for r in reports)}
        return table, common

    def find_latest(self, mode: RecoveryMode = RecoveryMode.LATEST) -> int | None:
        """Collective: the newest step every rank can obtain, or ``None``.

        Each rank reports its own memory slots, its own node-local files and
        what it holds for its peer (memory and disk); a newer step present on
        only part of the job is never chosen. ``RECOVERY_VERIFIED`` restricts
        the choice to steps every rank recorded as verified.
        """
        self._check_open()
        _, common = self._gather(RecoveryMode(mode))
        return max(common) if common else None

    def load(self, step: int | None = None, *, mode: RecoveryMode = RecoveryMode.LATEST) -> Any:
        """Collective: this rank's state tree at ``step`` (default: the newest common one).

        Each rank obtains its state from its cheapest source (own memory, own
        disk, peer memory, peer disk), validated before anything is returned.
        If any rank's state fails validation, every rank walks back to the next
        older common step (LATEST) or fails closed (RECOVERY_VERIFIED). Without
        any GEMINI step, ``load_fallback()`` is returned when given. Tensors are
        CPU tensors, bit-identical to the captured ones, owned by the caller.
        ``last_recovery`` then says which step and sources were used. Raises
        ``NoConsistentStep``.

        Restoring from own memory copies nothing: the slot's arena is handed to
        the caller and that slot is empty until the next capture (the step stays
        recoverable from the peer's replica and from disk where persisted).
        """
        self._check_open()
        mode = RecoveryMode(mode)
        t0 = time.perf_counter()
        table, common = self._gather(mode)
        t_agree = time.perf_counter() - t0
        if step is not None and step not in common:
            raise NoConsistentStep(
                f"step {step} is not available on every rank in mode {mode.value}; "
                f"common steps: {sorted(common)}. Call find_latest() first on every rank."
            )
        candidates = sorted((s for s in common if step is None or s <= step), reverse=True)
        ctx = self._fetch_context()
        failed: list[int] = []
        for s in candidates:
            t1 = time.perf_counter()
            fetched = fetch_step(s, table, ctx)
            if fetched is None:
                failed.append(s)
                if mode is RecoveryMode.RECOVERY_VERIFIED:
                    raise NoConsistentStep(
                        f"verified step {s} failed validation on at least one rank; "
                        "failing closed (RECOVERY_VERIFIED never falls back to unverified state)"
                    )
                log.warning("rank %d: step %d unusable on some rank; walking back", self.rank, s)
                continue
            m = fetched.material
            # Small tensors (RNG states, step counters) get storage of their own: some torch
            # APIs, e.g. set_rng_state, ignore a view's storage offset. Large ones stay views
            # of the private arena (no second copy).
            t2 = time.perf_counter()
            views = m.layout.views(m.arena)
            tensors = [v.clone() if v.nbytes < _OWN_STORAGE_BYTES else v for v in views]
            state = decode_state(m.document, tensors)
            t3 = time.perf_counter()
            phases = {"agree": t_agree, "fetch": t2 - t1, **fetched.phases_s, "decode": t3 - t2}
            self._record(
                RecoveryReport(s, [t[s].label for t in table], fetched.bytes_moved, failed, phases)
            )
            return state
        if self.load_fallback is not None:
            self._record(RecoveryReport(None, [Source.FALLBACK.label] * self.world_size, 0, failed))
            return self.load_fallback()
        raise NoConsistentStep(
            f"rank {self.rank}: no {mode.value} GEMINI step is available on every rank "
            f"(tried {failed or 'none'}) and no load_fallback was given; pass "
            "load_fallback=<load your durable checkpoint> to recover from it"
        )

    def _record(self, report: RecoveryReport) -> None:
        self.last_recovery = report
        log.info("gemini.recovery %s", json.dumps({"rank": self.rank, **asdict(report)}))

    def _fetch_context(self) -> FetchContext:
        def own_memory(step: int) -> Material | None:
            # The caller gets the slot's arena itself: restoring from memory copies nothing
            # (the slot allocates a fresh arena at its next capture, off the training thread).
            for slot in self._engine.complete_slots():
                if slot.step == step:
                    return Material(*slot.take(step))
            return None

        def held_memory(step: int) -> Material | None:
            # Served to its owner straight from the peer slot: nothing captures or rotates
            # peer slots while every rank is inside load().
            for slot in self._peer.complete_slots() if self._peer is not None else []:
                if slot.step == step:
                    with slot.reading(step) as s:
                        assert s.layout is not None and s.arena is not None
                        assert s.document is not None
                        return Material(s.layout, s.arena, s.document)
            return None

        def own_disk(step: int) -> Material:
            shard = self.store().read(owner_rank=self.rank, step=step)
            return Material(shard.layout, shard.arena, shard.state_document)

        def held_disk(step: int) -> ShardReader:
            # Opened and header-checked only: the bytes stream to their owner chunk by
            # chunk, verified there against the checksums stored with them.
            return self.store().open_reader(owner_rank=peer_owner, step=step)

        peer_owner = self.plan.recv_from(self.rank) if self.plan and self.plan.has_peer else -1
        return FetchContext(
            rank=self.rank,
            group=self._pg,
            run_id=self.run_id,
            plan=self.plan,
            channel=self._peer.channel if self._peer is not None else None,
            own_memory=own_memory,
            own_disk=own_disk,
            held_memory=held_memory,
            held_disk=held_disk,
        )

    def drop_memory(self) -> None:
        """Forget every in-memory slot, as a replaced process would (tests and drills)."""
        self._engine.wait_idle()
        self._flusher.wait_idle()
        for s in self._engine.slots:
            s.free()
        if self._peer is not None:
            for s in self._peer.slots:
                s.free()

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

    def close(self) -> None:
        """Finish in-flight work, optionally flush, stop the workers, free every arena."""
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.wait_idle()
        except ResiliencyError as exc:
            log.warning("rank %d: closing after a failed capture: %s", self.rank, exc)
        if self.config.flush_on_close:
            self.flush_newest()
        self._flusher.wait_idle()
        self._flusher.close()
        if self._signal is not None:
            self._signal.uninstall()
        self._engine.close()
        if self._peer is not None:
            self._peer.close()
        self._trust_jobs.shutdown(wait=True)
        if self._store is not None:
            self._store.close()

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
        self.close()

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
            self._in_background(lambda: self.store().mark_verified(step), f"verify step {step}")
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
        if self._store is None and not Path(self.config.disk_folder).is_dir():
            return None
        self.wait_trust()
        return self.store().status().verdict

    def wait_trust(self, timeout_s: float | None = None) -> bool:
        """Block until every background trust update so far is written; False on timeout."""
        with self._trust_lock:
            pending = list(self._trust_pending)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for job in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job.result(timeout=left)
            except FutureTimeout:
                return False
            except Exception:  # logged by the job itself
                continue
        with self._trust_lock:
            self._trust_pending = [j for j in self._trust_pending if not j.done()]
        return True

    def _in_background(self, job: Callable[[], object], what: str) -> None:
        def run() -> None:
            try:
                job()
            except Exception as exc:  # a failed trust write never stops training; logged
                log.warning("rank %d: writing trust record (%s) failed: %s", self.rank, what, exc)
                raise

        with self._trust_lock:
            self._trust_pending.append(self._trust_jobs.submit(run))

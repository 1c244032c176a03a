"""The trust ledger: SCOUT's certifications of captured steps, recorded at once, written later.

:class:`TrustLedger` is the GEMINI side of :class:`~lm_resiliency.detection.certify.TrustSink`
(SCOUT is given ``manager.trust``). Every call is local and non-blocking,
callable from an optimizer hook: the in-memory record (which steps are
``CANDIDATE``, ``RECOVERY_VERIFIED``, which need persisting, the recovery
verdict) changes under one lock at once, so ``find_latest`` of this process
sees it; the sidecar and trust-marker writes run on one background writer
thread (:class:`TrustWriter`), whose failures are logged and never stop
training. ``wait(timeout_s)`` blocks until every write submitted so far is done.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lm_resiliency import _strict_json as strict_json
from lm_resiliency.capture.gate import CommitGate
from lm_resiliency.checkpointing.disk import LocalDisk
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.persistence import RecoveryVerdict, TrustStatus
from lm_resiliency.persistence.namespace import catalog_file

log = logging.getLogger(__name__)

__all__ = ["TrustLedger", "TrustWriter"]


class TrustWriter:
    """A background writer for trust records, never on the step's path.

    ``submit(job, what)`` queues a sidecar or shard update on one worker thread
    and returns at once; ``wait(timeout_s)`` blocks until everything submitted so
    far is written. A failed write is logged and never stops training.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmr-trust")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], object], what: str) -> None:
        def run() -> None:
            try:
                job()
            except Exception as exc:
                log.warning("rank %d: writing trust record (%s) failed: %s", self._rank, what, exc)
                raise

        with self._lock:
            self._pending.append(self._pool.submit(run))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every update submitted so far is written; ``False`` on timeout."""
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for job in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job.result(timeout=left)
            except FutureTimeout:
                return False
            except Exception:  # logged by the job itself
                continue
        with self._lock:
            self._pending = [j for j in self._pending if not j.done()]
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class TrustLedger:
    """One rank's trust record of its captures (SCOUT's ``TrustSink``); see the module docstring.

    ``disk``: this rank's node-local store (its sidecar and markers are written
    there); ``serves_owner``: the rank whose replica this rank holds (its shard
    gets a trust marker too); ``persist(step)``: queues the step's complete slots
    for the node-local write (a capture still in flight is queued by the manager
    once complete, see :meth:`persist_requested`).
    """

    def __init__(
        self,
        rank: int,
        disk: LocalDisk,
        *,
        serves_owner: int | None,
        persist: Callable[[int], None],
    ) -> None:
        self._rank = rank
        self._disk = disk
        self._serves_owner = serves_owner
        self._persist = persist
        self._lock = threading.Lock()
        self._verified: set[int] = set()
        self._candidates: set[int] = set()
        self._persist_requested: set[int] = set()
        self._verdict: RecoveryVerdict | None = None
        self._writer = TrustWriter(rank)
        self._closed = False
        self._held: CommitGate | None = None

    # -- held captures (SCOUT's pipelined verdict) ---------------------------------

    def hold(self, step: int, resolve: Callable[[], object]) -> CommitGate:
        """Hold the next capture of ``step`` uncommitted until ``resolve`` decides it.

        ``manager.save(state, step)`` takes the gate (the capture's bytes are copied,
        its commit waits); ``manager.maybe_wait`` and the next ``save`` call
        ``resolve`` (collective in SCOUT) on the caller's thread. Replaces an
        undecided hold of an earlier step (resolving it first).
        """
        previous = self._held
        if previous is not None and not previous.decided:
            previous.resolve()
        self._held = gate = CommitGate(step, resolve)
        return gate

    def take_held(self, step: int) -> CommitGate | None:
        """The gate held for ``step`` (for ``save``), if any and undecided."""
        gate = self._held
        return gate if gate is not None and gate.step == step and not gate.decided else None

    def settle(self) -> None:
        """Caller's thread: resolve an undecided hold now (``maybe_wait``)."""
        gate = self._held
        if gate is not None:
            self._held = None
            gate.resolve()

    # -- TrustSink ---------------------------------------------------------------

    def certify(self, step: int, trust: TrustStatus, *, persist: bool = True) -> None:
        """Record the capture of ``step`` as ``trust`` (``CANDIDATE`` or ``RECOVERY_VERIFIED``).

        The in-memory record is immediate; the sidecar update and, with
        ``persist``, the node-local write of the step's own slot and the peer
        replica this rank holds (with ``trust`` in their headers) run in the
        background. A capture still in flight is written once it and its
        replication complete. Promoting a candidate to ``RECOVERY_VERIFIED`` needs
        no ``persist`` (its files exist). Raises ``ValueError`` for another trust
        or a bad step.
        """
        self._check_open()
        trust = TrustStatus(trust)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (a captured step)")
        if trust is TrustStatus.UNVERIFIED:
            raise ValueError("certify() records CANDIDATE or RECOVERY_VERIFIED, not UNVERIFIED")
        with self._lock:
            if trust is TrustStatus.RECOVERY_VERIFIED:
                self._verified.add(step)
                self._candidates.discard(step)
            else:
                self._candidates.add(step)
            if persist:
                self._persist_requested.add(step)
        if persist:
            self._persist(step)
        if trust is TrustStatus.RECOVERY_VERIFIED:
            # mark_verified also publishes the trust markers next to the shards.
            self._in_background(lambda: self.mark_verified(step), f"verify step {step}")
        else:
            store = self._disk.store
            self._in_background(lambda: store().sidecar.mark_candidate(step), f"candidate {step}")

    def reject(self, step: int, *, reason: str) -> None:
        """Record ``step`` as rejected (SCOUT found SDC before it was verified).

        ``step`` leaves the candidate and verified records at once; the sidecar
        keeps ``(step, reason)`` (written in the background), which
        ``lm-resiliency inspect`` shows. A rejected step is never chosen by
        ``RECOVERY_VERIFIED`` recovery.
        """
        self._check_open()
        with self._lock:
            self._verified.discard(step)
            self._candidates.discard(step)
        store = self._disk.store
        self._in_background(lambda: store().sidecar.mark_rejected(step, reason), f"reject {step}")

    def require_verified_recovery(self, step: int, *, reason: str) -> None:
        """Persist SCOUT's verdict "SDC seen at ``step``: recover in verified mode".

        The sidecar is written in the background. A job restarted on this folder
        finds it with :meth:`recovery_verdict`.
        """
        self._check_open()
        verdict = RecoveryVerdict(step=step, reason=reason)
        self._verdict = verdict
        store = self._disk.store
        self._in_background(lambda: store().sidecar.set_verdict(verdict), f"verdict at {step}")

    def clear_recovery_verdict(self) -> None:
        """Remove a persisted recovery verdict (after a verified recovery was certified)."""
        self._check_open()
        had = self.recovery_verdict() is not None
        self._verdict = None
        if had:
            store = self._disk.store
            self._in_background(lambda: store().sidecar.set_verdict(None), "clear verdict")

    def recovery_verdict(self) -> RecoveryVerdict | None:
        """This rank's recovery verdict: set in this process, or read from its own sidecar.

        Never creates the disk folder. ``None`` when no verdict was recorded.
        """
        if self._verdict is not None:
            return self._verdict
        self.wait()
        store = self._disk.existing()
        return None if store is None else store.sidecar.status().verdict

    # -- SCOUT's catalog ---------------------------------------------------------

    def save_catalog(self, doc: dict[str, Any]) -> None:
        """Persist SCOUT's replay catalog (shapes and argument structures, never tensors).

        ``doc`` is a JSON document (:mod:`lm_resiliency.detection.saved_catalog`); it
        replaces this rank's ``scout-catalog-rank-<R>.json`` beside the status sidecar,
        written in the background. A restarted job reads it back with
        :meth:`saved_catalog`, so it can sweep before its first forward.
        """
        self._check_open()
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        store = self._disk.store
        self._in_background(lambda: store().sidecar.write_catalog(body), "SCOUT catalog")

    def saved_catalog(self) -> Any:
        """This rank's saved SCOUT catalog as parsed strict JSON, ``None`` when there is none.

        Never creates the disk folder. Raises ``ValueError`` naming the file when it
        is not strict JSON (NaN, duplicate keys, bad UTF-8) or too large, and
        ``UnsafePathError`` when it is a link or not a file of ours.
        """
        self.wait()
        store = self._disk.existing()
        if store is None:
            return None
        raw = store.sidecar.read_catalog()
        if raw is None:
            return None
        try:
            return strict_json.loads(raw)
        except (ValueError, RecursionError) as exc:
            where = store.topology_path / catalog_file(self._rank)
            raise ValueError(f"{where} is not strict JSON ({exc})") from None

    # -- GEMINI's side -----------------------------------------------------------

    def mark_verified(self, step: int) -> None:
        """Record ``step`` as recovery-verified and write it (sidecar and trust markers) now."""
        with self._lock:
            self._verified.add(step)
        held = self._serves_owner
        owners = (self._rank,) if held is None else (self._rank, held)
        self._disk.store().sidecar.mark_verified(step, owners)

    def trust_of(self, step: int) -> TrustStatus:
        """The trust to record in a shard of ``step`` written now."""
        with self._lock:
            if step in self._verified:
                return TrustStatus.RECOVERY_VERIFIED
            return TrustStatus.CANDIDATE if step in self._candidates else TrustStatus.UNVERIFIED

    def persist_requested(self, step: int) -> bool:
        """Whether a certification asked for ``step`` to be written to node-local disk."""
        with self._lock:
            return step in self._persist_requested

    def verified(self) -> frozenset[int]:
        """The steps certified ``RECOVERY_VERIFIED`` in this process."""
        with self._lock:
            return frozenset(self._verified)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every background trust update so far is written; False on timeout."""
        return self._writer.wait(timeout_s)

    def stop(self) -> None:
        """Refuse further certifications (the manager closed or the process is exiting)."""
        self._closed = True

    def close(self) -> None:
        """Refuse further certifications and finish the queued writes."""
        self.stop()
        self._writer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ResiliencyError("this InMemoryCheckpointManager is closed; create a new one")

    def _in_background(self, job: Callable[[], object], what: str) -> None:
        self._writer.submit(job, what)

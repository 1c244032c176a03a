"""A worker's heartbeat thread: its lease, the coordinator watch and the cached flags.

Every ``heartbeat_s`` the thread, on its **own** store client (c10d serialises one client's
requests, so a shared client would stall behind another thread's request):

1. writes ``hb/<r>/<g>`` = ``{inc, epoch, committed, t}`` (the lease, and the newest committed
   step the coordinator needs, without a per-step RPC);
2. watches the coordinator: ``coord/beat`` unchanged for ``coordinator_timeout_s``, an EOF on
   the liveness socket, or a store error sets the *lost* flag;
3. caches ``fail/<E>`` (so :meth:`Lease.failed` costs no round trip once it is seen);
4. reads ``epoch``: a newer epoch that does not admit this incarnation sets the *evicted* flag;
   a newer ``"admit"`` epoch (a heal scheduled, docs/live-membership.md §6.2) is cached for
   :meth:`Lease.admission`, so members learn of it without a per-step request.

The flags are read by the caller's thread (:class:`~lm_resiliency.live.membership.Membership`),
which raises them at its next call; the thread never raises into anyone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import (
    EpochRecord,
    Failure,
    Heartbeat,
    Keys,
    decode,
    encode_text,
    parse_beat,
)
from lm_resiliency.live.liveness import LivenessClient
from lm_resiliency.live.view import CoordinatorLost

__all__ = ["Lease", "StoreErrors", "brief", "failure_cause"]

_log = logging.getLogger(__name__)

StoreErrors: tuple[type[BaseException], ...] = (dist.DistError, OSError)
"""What a store request to a dead, hung or unreachable coordinator raises."""


def brief(exc: BaseException) -> str:
    """The first line of a c10d error (its message is followed by a C++ stack)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@dataclass(frozen=True)
class _Identity:
    keys: Keys
    replica: int
    group_rank: int
    inc: str
    address: str


def failure_cause(store: dist.Store, keys: Keys, epoch: int) -> str | None:
    """``"fail/<E> by <who>: <reason>"`` if ``fail/<epoch>`` exists, else ``None``."""
    key = keys.failure(epoch)
    if not store.check([key]):
        return None
    try:
        f = decode(Failure, store.get(key), key=key)
    except ValueError as exc:
        return f"fail/{epoch} (unreadable: {exc})"
    return f"fail/{epoch} by {f.by}: {f.reason}"


class Lease:
    """The heartbeat thread of one worker rank and the flags it caches."""

    def __init__(
        self,
        *,
        identity: _Identity,
        config: LiveConfig,
        store_factory: Callable[[], dist.Store],
        liveness: LivenessClient,
        epoch: int,
    ) -> None:
        self._id = identity
        self._config = config
        self._store_factory = store_factory
        self._liveness = liveness
        self._lock = threading.Lock()
        self._epoch = epoch
        self._committed = 0
        self._joining = False
        self._failed: str | None = None
        self._lost: str | None = None
        self._evicted: EpochRecord | None = None
        self._admission: EpochRecord | None = None
        self._error: BaseException | None = None
        self._beat_since: float | None = None
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(
            target=self._run, name=f"lmr-live-lease-r{identity.replica}g{identity.group_rank}"
        )
        self._thread.daemon = True

    @staticmethod
    def identity(keys: Keys, replica: int, group_rank: int, inc: str, address: str) -> _Identity:
        return _Identity(keys, replica, group_rank, inc, address)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # Bounded: a request to a stopped coordinator never returns (the thread is a daemon).
            self._thread.join(self._config.coordinator_timeout_s + self._config.heartbeat_s)

    # -- what the caller's thread reads and sets -----------------------------------------

    def set_epoch(self, epoch: int, *, joining: bool = False) -> None:
        with self._lock:
            self._epoch, self._joining, self._failed = epoch, joining, None
            if self._evicted is not None and self._evicted.epoch <= epoch:
                # Seen from an older epoch (a joiner's first beats, before it registered as
                # joining, see that epoch 0 does not admit it): the caller is past it now.
                self._evicted = None

    def set_committed(self, step: int) -> None:
        with self._lock:
            self._committed = step

    @property
    def committed(self) -> int:
        with self._lock:
            return self._committed

    def failed(self) -> str | None:
        with self._lock:
            return self._failed

    def note_failed(self, epoch: int, cause: str) -> None:
        with self._lock:
            if epoch == self._epoch and self._failed is None:
                self._failed = cause

    def admission(self) -> EpochRecord | None:
        """The cached ``"admit"`` record of the epoch after this rank's, if one was seen."""
        with self._lock:
            adm = self._admission
            return adm if adm is not None and adm.epoch == self._epoch + 1 else None

    def flags(self) -> tuple[str | None, EpochRecord | None, BaseException | None]:
        """(lost, evicted, error): what the caller raises at its next call."""
        with self._lock:
            since = self._beat_since
            if since is not None and self._lost is None:
                stuck = time.monotonic() - since
                if stuck > self._config.coordinator_timeout_s:
                    self._lost = (
                        f"coordinator {self._id.address} silent (a heartbeat request has not "
                        f"returned for {stuck:.1f} s)"
                    )
            return self._lost, self._evicted, self._error

    def mark_lost(self, why: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = why

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            store = self._store_factory()
            last_beat: bytes | None = None
            last_change = time.monotonic()
            while not self._stop.is_set():
                with self._lock:
                    self._beat_since = time.monotonic()
                last_beat, last_change = self._beat(store, last_beat, last_change)
                with self._lock:
                    self._beat_since = None
                self._stop.wait(self._config.heartbeat_s)
        except StoreErrors as exc:
            self.mark_lost(f"coordinator {self._id.address} unreachable ({brief(exc)})")
        except CoordinatorLost as exc:  # from the store factory
            self.mark_lost(str(exc))
        except BaseException as exc:  # raised on the caller's thread at its next call
            with self._lock:
                self._error = exc

    def _beat(
        self, store: dist.Store, last_beat: bytes | None, last_change: float
    ) -> tuple[bytes | None, float]:
        ident, keys = self._id, self._id.keys
        with self._lock:
            epoch, committed, joining = self._epoch, self._committed, self._joining
        hb = Heartbeat(inc=ident.inc, epoch=epoch, committed=committed, t=time.time())
        store.set(keys.heartbeat(ident.replica, ident.group_rank), encode_text(hb))
        self.beats += 1
        beat = store.get(keys.beat)
        now = time.monotonic()
        if beat != last_beat:
            last_beat, last_change = beat, now
        elif now - last_change > self._config.coordinator_timeout_s:
            self.mark_lost(
                f"coordinator {ident.address} silent for {now - last_change:.1f} s "
                f"(coordinator_timeout_s={self._config.coordinator_timeout_s:g})"
            )
        if self._liveness.closed_by_peer():
            self.mark_lost(f"coordinator {ident.address} closed the liveness connection")
        # No read of the failure flag: the coordinator pokes every member when it flags a
        # change, and Membership.failed() reads it then. Two requests per beat in all.
        if not joining and parse_beat(beat) > epoch:
            key = keys.epoch_record(epoch + 1)
            record = decode(EpochRecord, store.get(key), key=key)
            if not record.admits(ident.replica, ident.group_rank, ident.inc):
                with self._lock:
                    if self._epoch == epoch and self._evicted is None:
                        self._evicted = record
            elif record.reason == "admit":
                with self._lock:
                    if self._epoch == epoch:
                        self._admission = record
        return last_beat, last_change

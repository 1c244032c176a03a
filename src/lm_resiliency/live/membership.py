"""Membership: one worker rank's live view of the replica membership (a ``MembershipView``).

Call order (every rank of every replica group, on its training thread)::

    m = Membership.from_env(LiveConfig())   # registers, waits (bounded) for epoch 0
    ...                                     # each step: m.failed() in polled waits
    m.set_committed(step)                   # after each commit (the heartbeat carries it)
    m.report_failure("Connection reset")    # a collective of this epoch failed
    record = m.reform(ack)                  # ack the failed epoch, adopt the next one
    m.close()

Registration writes ``hb/<r>/<g>`` and opens the liveness socket (a fresh uuid4 incarnation
per process); the coordinator publishes epoch 0 once all R x N ranks have registered. A
process that starts after the run began first claims its rank's vacancy (``owner/<r>/<g>``,
docs/live-membership.md §6.3; :class:`ReplicaTaken` when another process holds it), then
registers as a joiner (``join/<r>/<g>``) and is
admitted through a heal (:mod:`lm_resiliency.live.heal`, docs/live-membership.md §6):
``await_admission``, the receive, ``ack_heal``, ``await_admitted``. Members learn of an
admission from the heartbeat cache (``admission()``), ``enter_admission`` at the boundary
after its step and ``await_outcome``.

Every call raises what the background thread found since the last one: ``CoordinatorLost``
(``coord/beat`` silent for ``coordinator_timeout_s``, liveness EOF, a store error),
``Evicted`` (a newer epoch does not admit this incarnation), or the thread's own error.
No call waits without a bound: every wait polls in ``poll_slice_s`` slices.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TypeVar

import torch.distributed as dist

from lm_resiliency.errors import ConfigError
from lm_resiliency.live.bounded import BoundedStore, Requester
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import (
    OPEN,
    Ack,
    CoordRecord,
    EpochRecord,
    Failure,
    Join,
    Keys,
    decode,
    encode_text,
)
from lm_resiliency.live.lease import Lease, StoreErrors, brief, failure_cause
from lm_resiliency.live.liveness import LivenessClient
from lm_resiliency.live.view import (
    BelowMinReplicas,
    CoordinatorLost,
    Evicted,
    ReplicaTaken,
    RunFinished,
)

__all__ = ["Change", "Membership", "coordinator_address"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Change:
    """The last membership change this rank adopted (``Membership.last_change``)."""

    epoch: int
    reason: str
    cause: str
    effective_step: int
    """The first step the new membership computes (``resume_step + 1``)."""
    t_detect: float
    t_publish: float
    agree_s: float
    """The coordinator's detection to its publication of the epoch."""
    adopt_s: float
    """The publication to this rank adopting the epoch."""
    rebuild_s: float = 0.0
    redo_s: float = 0.0
    heal_s: float = 0.0
    """Filled by the layers that rebuild the group, redo the step and heal (0 until then)."""

    @classmethod
    def of(cls, record: EpochRecord, adopted_at: float) -> Change:
        return cls(
            epoch=record.epoch,
            reason=record.reason,
            cause=record.cause,
            effective_step=record.effective_step,
            t_detect=record.t_detect,
            t_publish=record.t_publish,
            agree_s=max(0.0, record.t_publish - record.t_detect),
            adopt_s=max(0.0, adopted_at - record.t_publish),
        )


class Membership:
    """One worker rank's membership: registration, lease, failure flag, reform.

    Implements :class:`lm_resiliency.live.view.MembershipView`. The public methods are for
    one caller thread (the training thread); the heartbeat thread has its own store client.
    """

    def __init__(
        self,
        config: LiveConfig,
        *,
        host: str,
        port: int,
        run: str,
        replica: int,
        replicas: int,
        group_rank: int,
        join_at: int = 0,
        incarnation: str = "",
    ) -> None:
        """``incarnation``: the one a warm spare was given with its takeover (the coordinator
        already swapped it into the rank's ``owner/`` key); empty: a fresh uuid4."""
        self._join_at = join_at
        if not 0 <= replica < replicas:
            raise ConfigError(
                f"replica group {replica} is outside 0..{replicas - 1} (LMR_REPLICA_GROUP must "
                f"be below LMR_REPLICA_GROUPS={replicas})"
            )
        self.config = config
        self._keys = Keys(run)
        self._host, self._port = host, port
        self._address = f"{host}:{port}"
        self._replica, self._replicas, self._group_rank = replica, replicas, group_rank
        self.incarnation = incarnation or uuid.uuid4().hex
        self._local = threading.local()
        self._epoch = 0
        self._members: tuple[int, ...] = ()
        self.joining = False
        """True when this process registered after the run began (it waits for admission)."""
        self._registered_at = 0
        self.requests = 0
        """Store requests made through :meth:`_ask` (the training and watcher threads; the
        heartbeat thread's own client is not counted)."""
        self.last_change: Change | None = None
        self._closed = False
        self._liveness: LivenessClient | None = None
        self._lease: Lease | None = None
        self._stores: list[BoundedStore] = []
        self._requests = Requester(self._client, f"lmr-live-requests-r{replica}g{group_rank}")
        try:
            self._register()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_env(
        cls,
        config: LiveConfig | None = None,
        env: Mapping[str, str] | None = None,
        *,
        join_at: int = 0,
        replica: int | None = None,
        incarnation: str = "",
    ) -> Membership:
        """Register from the launcher's environment (docs/live-membership.md §1).

        ``join_at``: when this process joins a running job, the heal step it asks for (a
        scripted ``join@R:S`` asks for ``S - 1``); 0 lets the coordinator choose.
        ``replica``/``incarnation``: a warm spare's takeover (else ``LMR_REPLICA_GROUP``).
        """
        env = os.environ if env is None else env
        host, port = coordinator_address(env)
        return cls(
            config or LiveConfig(),
            host=host,
            port=port,
            run=env.get("LMR_LIVE_RUN", ""),
            replica=_env_int(env, "LMR_REPLICA_GROUP", None) if replica is None else replica,
            replicas=_env_int(env, "LMR_REPLICA_GROUPS", None),
            group_rank=_env_int(env, "RANK", 0),
            join_at=join_at,
            incarnation=incarnation,
        )

    # -- MembershipView ------------------------------------------------------------------

    @property
    def keys(self) -> Keys:
        return self._keys

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self._members

    @property
    def replica(self) -> int:
        return self._replica

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def group_rank(self) -> int:
        return self._group_rank

    @property
    def index(self) -> int:
        """This replica's rank in the epoch's cross-replica group."""
        return self._members.index(self._replica)

    def store(self) -> dist.Store:
        """This thread's own client, every request of it bounded (docs/live-membership.md §2.5).

        A request may take the store's timeout (``coordinator_timeout_s``, or what
        ``set_timeout`` sets) plus ``coordinator_timeout_s``; one that does not return by then
        (a stopped coordinator never answers) marks the membership lost and raises
        ``CoordinatorLost`` naming the coordinator's address.
        """
        client: BoundedStore | None = getattr(self._local, "store", None)
        if client is None:
            client = BoundedStore(
                self._client,
                address=self._address,
                timeout_s=self.config.coordinator_timeout_s,
                slack_s=self.config.coordinator_timeout_s,
                on_lost=self._mark_lost,
                name=f"lmr-live-store-r{self._replica}g{self._group_rank}",
            )
            self._stores.append(client)
            self._local.store = client
        return client

    def _client(self) -> dist.Store:
        """A new raw client of the coordinator's store (its requests are not bounded)."""
        try:
            return dist.TCPStore(
                self._host,
                self._port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.config.coordinator_timeout_s),
            )
        except StoreErrors as exc:
            raise CoordinatorLost(
                f"live coordinator {self._address} unreachable ({brief(exc)}); falling back to "
                "whole-job restart with memory recovery"
            ) from exc

    def _mark_lost(self, why: str) -> None:
        if self._lease is not None:
            self._lease.mark_lost(why)

    def failed(self) -> str | None:
        """The failure flag of this rank's epoch, if set. No store request unless the
        coordinator poked this process (it does when it flags a change): the cross-replica
        group's watcher calls it at every collective. The heartbeat thread also reads the
        flag at every beat."""
        self._raise_pending()
        lease = self._running_lease()
        cause = lease.failed()
        if cause is None and self._liveness is not None and self._liveness.take_pokes():
            epoch = self._epoch  # one value: the cause is cached for the epoch it was read for
            cause = self._ask(lambda s: failure_cause(s, self._keys, epoch))
            if cause is not None:
                lease.note_failed(epoch, cause)
        return cause

    def report_failure(self, reason: str) -> None:
        self._raise_pending()
        flag = Failure(by=self._who, reason=reason, t=time.time(), inc=self.incarnation)
        key = self._keys.failure(self._epoch)
        self._ask(lambda s: s.compare_set(key, "", encode_text(flag)))

    def reform(self, ack: Ack) -> EpochRecord:
        self._raise_pending()
        epoch = self._epoch
        ack = dataclasses.replace(ack, inc=self.incarnation, pid=os.getpid())
        ack_key = self._keys.ack(epoch, self._replica, self._group_rank)
        self._ask(lambda s: s.set(ack_key, encode_text(ack)))
        if self.failed() is None:  # reforming starts a change if nobody flagged one
            self.report_failure("reform")
        target = epoch + 1
        # The coordinator may wait ack_timeout_s for a member still busy in its step.
        bound_s = self.config.ack_timeout_s + self.config.reform_timeout_s
        deadline = time.monotonic() + bound_s
        while True:
            key = self._keys.epoch_record(target)
            while not self._ask(lambda s, key=key: s.check([key])):  # type: ignore[misc]
                if time.monotonic() > deadline:
                    raise CoordinatorLost(
                        f"no membership epoch {target} from the live coordinator "
                        f"{self._address} within ack_timeout_s + reform_timeout_s = "
                        f"{bound_s:g} s; falling back to whole-job restart with memory recovery"
                    )
                time.sleep(self.config.poll_slice_s)
                self._raise_pending(evicted=False)
            record = decode(EpochRecord, self._get(key), key=key)
            if record.reason != "admit":
                break
            # A heal was scheduled while this rank was still in epoch ``epoch`` (stepping
            # towards h): the change that answers this failure is the epoch after it.
            target += 1
        self._adopt(record)
        return record

    # -- beyond the view -----------------------------------------------------------------

    def check(self) -> None:
        """Raise what the heartbeat thread found (``CoordinatorLost``, ``Evicted``); no request.

        The front door calls it at every step boundary (docs/live-membership.md §2.5): the
        steps' collectives do not involve the coordinator, so without it a run whose
        coordinator died would go on until its next membership request.
        """
        self._raise_pending()

    @property
    def committed(self) -> int:
        return self._running_lease().committed

    def set_committed(self, step: int) -> None:
        """Record the newest committed step; the next heartbeat carries it."""
        self._running_lease().set_committed(step)

    def register_join(self, slot_step: int = 0) -> None:
        """Register this rank as joining (``join/<r>/<g>``); the admission is the heal's."""
        record = Join(inc=self.incarnation, host=os.uname().nodename, pid=os.getpid(),
                      slot_step=slot_step, at_step=self._join_at)  # fmt: skip
        key = self._keys.join(self._replica, self._group_rank)
        self._ask(lambda s: s.set(key, encode_text(record)))
        self.joining = True
        self._running_lease().set_epoch(self._epoch, joining=True)

    # -- admission (docs/live-membership.md §6; live/heal.py drives these) -------------------

    def admission(self) -> EpochRecord | None:
        """The ``"admit"`` record of the next epoch if the heartbeat thread has seen one.

        Cheap (a cached field, no request): members read it at every step boundary and keep
        stepping until they committed its ``heal["step"]``.
        """
        return self._running_lease().admission()

    def enter_admission(self, record: EpochRecord) -> None:
        """A member at the boundary after h adopts the ``"admit"`` epoch (members unchanged)."""
        self._raise_pending()
        if (
            record.reason != "admit"
            or record.epoch != self._epoch + 1
            or not record.admits(self._replica, self._group_rank, self.incarnation)
        ):
            raise ValueError(
                f"epoch {record.epoch} ({record.reason!r}) is not an admission following epoch "
                f"{self._epoch} for r{self._replica}g{self._group_rank}"
            )
        self._epoch = record.epoch
        self._running_lease().set_epoch(record.epoch)

    def await_outcome(self) -> EpochRecord:
        """A member in an ``"admit"`` epoch: wait for the next epoch and adopt it.

        That is the joiner admitted (``"admitted"``), the admission cancelled, or, when this
        epoch failed meanwhile (the donor died), the answer to this rank's :meth:`reform`.
        The coordinator decides every case (the donor's send, the joiner's ack and every
        rank's liveness are bounded); ``join_timeout_s`` is the backstop.
        """
        return self._await_next(self.config.join_timeout_s, reform=True)

    def await_admission(self) -> EpochRecord:
        """A joiner: wait (bounded by ``join_timeout_s``) for an ``"admit"`` epoch naming it,
        or for a fresh ``"start"`` epoch that makes it a member (``joining`` is then False)."""
        self._raise_pending(evicted=False)
        keys = self._keys
        deadline = time.monotonic() + self.config.join_timeout_s
        seen = -1
        while True:
            current = int(self._ask(lambda s: s.get(keys.epoch)))
            if current != seen:
                seen = current
                key = keys.epoch_record(current)
                record = decode(EpochRecord, self._get(key), key=key)
                _raise_if_finished(record)
                if record.heals(self._replica, self._group_rank, self.incarnation):
                    self._epoch, self._members = record.epoch, record.members
                    self._running_lease().set_epoch(record.epoch, joining=True)
                    return record
                other = record.incarnations.get(f"{self._replica}/{self._group_rank}")
                if record.epoch > self._registered_at and other not in (None, self.incarnation):
                    # This rank's claim was reopened (a spare too slow to say hello) and
                    # another process holds it: this one can never be admitted.
                    raise ReplicaTaken(self._replica, self._group_rank, other)
                if record.reason == "start" and record.admits(
                    self._replica, self._group_rank, self.incarnation
                ):
                    # Every member left before this joiner was healed, and the coordinator
                    # started a fresh membership naming it: a member now, not a joiner.
                    self.joining = False
                    self._adopt(record)
                    return record
            if time.monotonic() > deadline:
                raise CoordinatorLost(
                    f"replica {self._replica} rank {self._group_rank} was not scheduled for "
                    f"admission by the live coordinator {self._address} within join_timeout_s="
                    f"{self.config.join_timeout_s:g} (epoch {seen}); falling back to whole-job "
                    "restart with memory recovery"
                )
            time.sleep(self.config.poll_slice_s)
            self._raise_pending(evicted=False)

    def ack_heal(self, record: EpochRecord, *, digest: str = "", error: str = "") -> None:
        """A joiner: ack the heal of ``record`` with the digest of what it loaded (or why not)."""
        assert record.heal is not None
        ack = Ack(inc=self.incarnation, committed=record.heal["step"], pid=os.getpid(),
                  digest=digest, error=error)  # fmt: skip
        key = self._keys.ack(record.epoch, self._replica, self._group_rank)
        self._ask(lambda s: s.set(key, encode_text(ack)))

    def await_admitted(self, record: EpochRecord) -> EpochRecord | None:
        """A joiner that acked ``record``'s heal: the next epoch if it admits it, else None.

        None means the admission was cancelled or the donor was lost; the joiner stays
        registered and waits for the next admission (:meth:`await_admission`).
        """
        if self._epoch != record.epoch:
            raise ValueError(f"this joiner is in epoch {self._epoch}, not {record.epoch}")
        nxt = self._await_next(self.config.join_timeout_s, reform=False)
        return nxt if nxt.admits(self._replica, self._group_rank, self.incarnation) else None

    def _await_next(self, timeout_s: float, *, reform: bool) -> EpochRecord:
        key = self._keys.epoch_record(self._epoch + 1)
        deadline = time.monotonic() + timeout_s
        while not self._ask(lambda s: s.check([key])):
            if reform and self.failed() is not None:
                return self.reform(Ack(inc="", committed=self.committed))
            if time.monotonic() > deadline:
                raise CoordinatorLost(
                    f"no membership epoch {self._epoch + 1} from the live coordinator "
                    f"{self._address} within {timeout_s:g} s of an admission; falling back to "
                    "whole-job restart with memory recovery"
                )
            time.sleep(self.config.poll_slice_s)
            self._raise_pending(evicted=False)
        record = decode(EpochRecord, self._ask(lambda s: s.get(key)), key=key)
        _raise_if_finished(record)
        if self.joining:
            if not record.admits(self._replica, self._group_rank, self.incarnation):
                self._epoch, self._members = record.epoch, record.members
                self._running_lease().set_epoch(record.epoch, joining=True)
                return record
            self.joining = False
        self._adopt(record)
        return record

    def finish(self, step: int, *, timeout_s: float | None = None) -> bool:
        """A member at the end of training: publish ``done/<E>/<r>/<g>`` = ``step`` (its last
        committed step) and wait, at most ``timeout_s`` (``reform_timeout_s``), until every
        member's rank of the same group rank published it too. Call on every member rank,
        then :meth:`close`. True when all did within the bound.

        A member that left while another still waited for the last step's confirmation
        would be a lost replica to it: that one would redo the step alone. The coordinator
        reads these keys too: a member that closes after publishing ``done/`` finished, it
        was not lost, and once every member finished it publishes a ``"finished"`` epoch
        (a replica restarted after that gets :class:`RunFinished`).
        """
        self._raise_pending(evicted=False)
        epoch, g = self._epoch, self._group_rank
        mine = self._keys.done(epoch, self._replica, g)
        self._ask(lambda s: s.set(mine, str(step)))
        wanted = [self._keys.done(epoch, r, g) for r in self._members]
        bound_s = self.config.reform_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound_s
        while not self._ask(lambda s: s.check(wanted)):
            if time.monotonic() > deadline:
                return False
            time.sleep(self.config.poll_slice_s)
        return True

    def close(self) -> None:
        """Stop the heartbeat thread and close the liveness socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._lease is not None:
            self._lease.stop()
        if self._liveness is not None:
            self._liveness.close()
        self._requests.close()
        for store in self._stores:
            store.close()
        self._local = threading.local()

    def __enter__(self) -> Membership:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    @property
    def _who(self) -> str:
        return f"r{self._replica}g{self._group_rank}"

    def _register(self) -> None:
        keys = self._keys
        deadline = time.monotonic() + self.config.join_timeout_s
        while not self._ask(lambda s: s.check([keys.coord])):
            self._wait_slice(deadline, "the coordinator's record")
        coord = decode(CoordRecord, self._ask(lambda s: s.get(keys.coord)), key=keys.coord)
        if self._ask(lambda s: s.check([keys.epoch])):
            self._claim()  # the run began: only the holder of the rank's vacancy registers
        self._liveness = LivenessClient(
            self._host,
            coord.live_port,
            replica=self._replica,
            group_rank=self._group_rank,
            inc=self.incarnation,
            timeout_s=self.config.coordinator_timeout_s,
        )
        identity = Lease.identity(
            keys, self._replica, self._group_rank, self.incarnation, self._address
        )
        self._lease = Lease(
            identity=identity,
            config=self.config,
            store_factory=self._client,
            liveness=self._liveness,
            epoch=0,
        )
        # The first heartbeat is written before the coordinator can count this rank.
        lease = self._lease
        self._ask(lambda s: lease._beat(s, None, time.monotonic()))
        self._lease.start()
        first = keys.epoch_record(0)
        while not self._ask(lambda s: s.check([first])):
            self._wait_slice(deadline, "membership epoch 0 (every replica's ranks registering)")
            self._raise_pending()
        record = decode(EpochRecord, self._ask(lambda s: s.get(first)), key=first)
        if record.admits(self._replica, self._group_rank, self.incarnation):
            self._adopt(record)
            return
        # The run began before this process: it joins (admission and heal are §6's). When
        # the membership is gone (no member left to heal it), the coordinator starts a fresh
        # one once every rank has registered again, and await_admission returns it.
        current = int(self._ask(lambda s: s.get(keys.epoch)))
        key = keys.epoch_record(current)
        record = decode(EpochRecord, self._get(key), key=key)
        # Even after a "finished" epoch: it registers as a joiner, and await_admission
        # raises RunFinished (the front door has logged live.joining by then).
        self._epoch, self._members = record.epoch, record.members
        self._registered_at = record.epoch  # a dead predecessor may still be named in it
        self.register_join()

    def _claim(self) -> None:
        """Hold ``owner/<r>/<g>`` before saying hello as this rank (docs/live-membership.md §6.3).

        A vacancy (``open:<k>``) is swapped for this incarnation; one this process was given
        (a spare's takeover) is kept. Any other value is another process's: a warm spare
        that took the replica over, a member, or a member whose death the coordinator has
        not seen yet; :class:`ReplicaTaken` makes this process a spare, and a spare whose
        own replica opens again claims it back.
        """
        key = self._keys.owner(self._replica, self._group_rank)
        mine = self.incarnation
        for _ in range(8):  # each lost swap means another claimant won a newer vacancy
            value = self._get(key).decode() if self._ask(lambda s: s.check([key])) else ""
            if value == mine:
                return
            if not value and self._current_record().reason == "finished":
                return  # registers as a joiner and is told the run is over (RunFinished)
            if not value.startswith(OPEN):
                raise ReplicaTaken(self._replica, self._group_rank, value or "a member")
            if self._ask(lambda s, v=value: s.compare_set(key, v, mine)) == mine.encode():  # type: ignore[misc]
                return
        raise ReplicaTaken(self._replica, self._group_rank, "other claimants")

    def _current_record(self) -> EpochRecord:
        current = int(self._ask(lambda s: s.get(self._keys.epoch)))
        key = self._keys.epoch_record(current)
        return decode(EpochRecord, self._get(key), key=key)

    def _wait_slice(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise CoordinatorLost(
                f"no {what} on the live coordinator {self._address} within join_timeout_s="
                f"{self.config.join_timeout_s:g}"
            )
        time.sleep(self.config.poll_slice_s)

    def _adopt(self, record: EpochRecord) -> None:
        _raise_if_finished(record)
        if not record.members:
            raise BelowMinReplicas(
                f"membership epoch {record.epoch} has no members ({record.cause}); falling "
                "back to whole-job restart with memory recovery"
            )
        if not record.admits(self._replica, self._group_rank, self.incarnation):
            raise Evicted(record.epoch, f"{record.reason}: {record.cause}".rstrip(": "))
        self._epoch, self._members = record.epoch, record.members
        self.last_change = Change.of(record, time.time())
        self._running_lease().set_epoch(record.epoch)

    def _running_lease(self) -> Lease:
        if self._closed or self._lease is None:
            raise RuntimeError(f"Membership of {self._who} is closed; make a new one")
        return self._lease

    def _raise_pending(self, *, evicted: bool = True) -> None:
        lost, record, error = self._running_lease().flags()
        if error is not None:
            raise RuntimeError(f"live membership heartbeat thread failed: {error!r}") from error
        if lost is not None:
            raise CoordinatorLost(
                f"live membership: {lost}; falling back to whole-job restart with memory recovery"
            )
        if evicted and record is not None:
            self._adopt(record)  # raises Evicted or BelowMinReplicas

    def _get(self, key: str) -> bytes:
        return self._ask(lambda s: s.get(key))

    def _ask(self, request: Callable[[dist.Store], _T]) -> _T:
        """Run one request on this thread's client; a store error means the coordinator is
        gone (every request is bounded by ``coordinator_timeout_s``)."""
        self.requests += 1
        return self._requests.ask(
            request,
            self.config.coordinator_timeout_s,
            address=self._address,
            who="live membership",
            then="falling back to whole-job restart with memory recovery",
            on_lost=None if self._lease is None else self._lease.mark_lost,
        )


def coordinator_address(env: Mapping[str, str]) -> tuple[str, int]:
    """``LMR_LIVE_COORDINATOR`` as (host, port); ``ConfigError`` naming the fix."""
    address = env.get("LMR_LIVE_COORDINATOR", "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"LMR_LIVE_COORDINATOR={address!r} must be host:port of the live coordinator "
            "(lm-resiliency launch sets it), e.g. 127.0.0.1:29600"
        )
    return host, int(port)


def _raise_if_finished(record: EpochRecord) -> None:
    if record.reason == "finished":
        raise RunFinished(record.epoch, record.resume_step, record.cause)


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int:
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    if raw is None or not raw.strip().isdigit():
        raise ConfigError(
            f"{name}={raw!r} must be a non-negative integer (lm-resiliency launch sets it; "
            "see docs/live-membership.md §1)"
        )
    return int(raw)

"""The membership coordinator: its state and its decision loop (docs/live-membership.md §2.2-2.3).

One small process outside every replica group owns the ``TCPStore`` and runs
:meth:`Coordinator.run` on one thread (it is the only user of its store client). Each
iteration waits on the liveness sockets for at most ``decision_tick_s`` (an EOF wakes it at
once), then:

1. ``add``-s ``coord/beat`` (the workers' sign that the coordinator lives);
2. before epoch 0: waits until all R x N ranks have connected, then publishes ``epoch/0``;
   after an epoch with no members (every member gone), the same with ranks whose
   incarnations were never members: a fresh ``"start"`` epoch (:meth:`Coordinator._restart`);
3. reads the members' heartbeats (one ``multi_get``), and starts a change on the first of a
   liveness EOF, a ``fail/<E>`` key, or an expired lease;
4. during a change: writes ``fail/<E>`` if absent, collects ``ack/<E>/<r>/<g>`` until every
   member rank has acked or is dead (EOF, or a heartbeat older than ``stale_s``), capped at
   ``ack_timeout_s`` for ranks that are alive but busy in their step; then publishes
   ``epoch/<E+1>`` and ``epoch``;
5. registers joiners (``join/<r>/<g>`` of an incarnation whose liveness socket is open); an
   admission is scheduled once all N ranks of a replica joined and no change is under way
   (:meth:`Coordinator.schedule_admission`): ``epoch/<E+1>`` with the members unchanged,
   ``reason="admit"`` and ``heal={joiner, donor, step h}``;
6. a member rank whose socket closes (or lease expires) after it published
   ``done/<E>/<r>/<g>`` finished, it was not lost: no change begins; once every member rank
   finished, the ``"finished"`` epoch (no members, ``resume_step`` the last committed step)
   is published and the loop only beats from then on (:meth:`Coordinator._finish`);
7. during an admission: once every member committed h (heartbeats) and every joiner rank
   acked the heal with its digest, publishes ``epoch/<E+2>`` with the joiner among the
   members (``reason="admitted"``). A joiner that dies, goes silent for ``lease_s`` or acks
   an error cancels it: ``epoch/<E+2>`` with the old members (``"admission cancelled"``),
   published once every member committed h. A loss during an admission is a normal change
   (the joiner stays registered and is scheduled again with the next donor). Members may
   still be in epoch E (stepping towards h) while E+1 is published, so during an admission
   ``fail/``, ``ack/`` and heartbeats of epochs E and E+1 both count.

Vacancies and warm spares (docs/live-membership.md §6.3): when a member rank is seen dead,
and for every rank of a replica a published epoch drops (before the record), its
``owner/<r>/<g>`` is set to ``open:<k>``. A
process may register as that rank only after swapping its own incarnation in
(``compare_set`` from the open value, so exactly one claimant wins): a restarted worker
(:class:`~lm_resiliency.live.membership.Membership` claims) or a warm spare the coordinator
assigns. A spare waits on its liveness socket (replica ``-1``, group rank its spare id); the
coordinator swaps a fresh incarnation into the vacancy of a *lost* replica (not one that left
on purpose), writes ``spare/<s>/take`` and pokes the spare's socket. A claimant that dies
before it is a member, or a spare that does not say hello as the replica within
``coordinator_timeout_s``, reopens the vacancy. None of this costs a request while no
vacancy and spare are both there.

Fencing: heartbeats, acks and ``fail/`` keys of an incarnation that is not a member of the
current epoch, or of an older epoch, are ignored.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch.distributed as dist

from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import (
    Ack,
    CoordRecord,
    EpochRecord,
    Failure,
    Heartbeat,
    Join,
    Keys,
    Takeover,
    beat_value,
    decode,
    encode_text,
)
from lm_resiliency.live.liveness import Gone, Hello, LivenessServer

__all__ = ["Admission", "Coordinator", "Decision", "Joiner"]

_log = logging.getLogger(__name__)

Rank = tuple[int, int]
"""(replica, group rank)."""


@dataclass(frozen=True)
class Decision:
    """One published membership change (an entry of the coordinator's history)."""

    epoch: int
    members: tuple[int, ...]
    reason: str
    cause: str
    t_detect: float
    """Wall-clock time (``time.time()``) the coordinator noticed the loss."""
    t_publish: float
    resume_step: int


@dataclass
class Joiner:
    """A replica registering to join (a restarted group, or a spare): its ranks' records."""

    replica: int
    ranks: dict[int, Join] = field(default_factory=dict)
    registered_at: float = 0.0
    scheduled: bool = False


@dataclass
class Admission:
    """A scheduled heal (``epoch/<admit_epoch>``, reason ``"admit"``) until its outcome."""

    joiner: int
    donor: int
    step: int
    """h: every member commits h, then the donor streams its state at step h."""
    base_epoch: int
    """The epoch the members were in when it was scheduled (``admit_epoch - 1``)."""
    admit_epoch: int
    incarnations: dict[int, str]
    """The joiner's group rank to its incarnation."""
    t_scheduled: float
    cancelled: str = ""
    """Why the admission is cancelled (empty while it goes on)."""
    digests: dict[int, str] = field(default_factory=dict)
    """The digest each joiner rank acked."""
    beats: dict[int, tuple[bytes, float]] = field(default_factory=dict)
    """Each joiner rank's last heartbeat and when it changed (``time.monotonic()``)."""


@dataclass
class _Member:
    inc: str
    pid: int
    seen: float
    """``time.monotonic()`` of the last heartbeat accepted (or of the hello)."""
    raw: bytes = b""
    committed: int = 0
    dead: str = ""
    """Why this rank is known dead (empty while it lives)."""
    finished: int | None = None
    """The last committed step it published in ``done/`` before it closed (None: it did
    not finish; a finished rank is gone, not lost)."""


@dataclass
class _Pending:
    """A change being decided: the causes so far and the acks collected."""

    t_detect: float
    deadline: float
    causes: list[str]
    leave: bool = False
    acks: dict[Rank, Ack] = field(default_factory=dict)


class Coordinator:
    """The state of the membership and the decision loop; one thread calls ``run``/``step``."""

    def __init__(
        self,
        store: dist.Store,
        keys: Keys,
        *,
        replicas: int,
        nproc_per_group: int,
        config: LiveConfig,
        generation: int = 0,
        host: str = "",
    ) -> None:
        if replicas < 1 or nproc_per_group < 1:
            raise ValueError(
                f"replicas={replicas} and nproc_per_group={nproc_per_group} must be >= 1"
            )
        if config.min_replicas > replicas:
            raise ValueError(
                f"min_replicas={config.min_replicas} exceeds replicas={replicas}; the job "
                f"could never run. Use min_replicas <= {replicas}"
            )
        self.store = store
        self.keys = keys
        self.replicas = replicas
        self.nproc = nproc_per_group
        self.config = config
        self.generation = generation
        self.liveness = LivenessServer(host)
        self.epoch = -1
        """The published epoch; -1 until every rank has registered."""
        self.members: tuple[int, ...] = ()
        self.history: list[Decision] = []
        self.joiners: dict[int, Joiner] = {}
        self._ranks: dict[Rank, _Member] = {}
        self._registered: dict[Rank, Hello] = {}
        self._pending: _Pending | None = None
        self.admission: Admission | None = None
        self._floor = 0
        """The oldest epoch a member may still be in (older than ``epoch`` during an
        admission: members step in E while ``epoch/<E+1>`` says "admit")."""
        self._connected: dict[Rank, Hello] = {}
        """Open liveness connections (rank to its hello), joiners' included."""
        self._retired: set[str] = set()
        """Incarnations that were members once: never part of a fresh start."""
        self._progress: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._ignored: set[tuple[str, str]] = set()
        self._costs: collections.deque[float] = collections.deque(maxlen=100_000)
        self._next_read = 0.0
        """``perf_counter`` time of the next heartbeat read and coordinator beat."""
        self._spares: dict[str, int] = {}
        """Connected warm spares waiting: their incarnation to their spare id."""
        self._opened = 0
        self._vacant: dict[Rank, str] = {}
        """Vacant ranks to the ``open:<k>`` value this coordinator wrote (a claimant may have
        swapped it since: the swap for a spare then fails and the entry goes)."""
        self._spare_for: set[int] = set()
        """Vacant replicas a spare may take (lost, not left on purpose)."""
        self._left: set[int] = set()
        """Replicas that left on purpose (``leave``): no spare takes their place."""
        self._takeovers: dict[str, tuple[Rank, float]] = {}
        """A spare's new incarnation to its rank and the ``time.monotonic()`` deadline of its
        hello as that rank."""
        self.takeovers: list[tuple[int, int, float]] = []
        """(replica, spare id, wall-clock time) of every assignment made."""
        store.set(keys.coord, encode_text(CoordRecord(generation, os.getpid(), self.liveness.port)))
        self._beats = 1
        store.set(keys.beat, beat_value(self._beats, self.epoch))

    # -- the loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run the decision loop until ``stop`` is set."""
        while not stop.is_set():
            self.step(self.config.decision_tick_s)

    def step(self, wait_s: float) -> None:
        """One iteration: wait up to ``wait_s`` on the liveness sockets, then decide."""
        events = self.liveness.poll(wait_s)
        t0 = time.perf_counter()
        # The heartbeats change once per heartbeat_s: read them (and beat) twice as often, not
        # every tick, unless a change or an admission is under way. The failure flag is still
        # read every tick. (Every tick cost 3 store requests, about 4% of a core.)
        due = t0 >= self._next_read
        if due:
            self._next_read = t0 + self.config.heartbeat_s / 2
            self._beat()
        for event in events:
            self._on_liveness(event)
        if self.epoch < 0:
            if len(self._registered) == self.replicas * self.nproc:
                self._start()
        elif self.finished:
            pass  # the run is over: nothing to decide; restarted workers read the record
        elif not self.members:
            self._restart()
        else:
            if due or self._pending is not None or self.admission is not None:
                self._read_heartbeats()
            self._check_failure_key()
            if self._takeovers:
                self._expire_takeovers()
            if self._spare_for and self._spares and self._pending is None:
                self._assign_spares()
            self._register_joiners()
            if self._pending is not None:
                self._collect_acks()
            elif self.admission is not None:
                self._check_admission()
        self._costs.append(time.perf_counter() - t0)

    def _beat(self) -> None:
        """``coord/beat``: the sign that the coordinator lives, with the published epoch (a
        worker's heartbeat reads both in one request)."""
        self._beats += 1
        self.store.set(self.keys.beat, beat_value(self._beats, self.epoch))

    def tick_costs_s(self) -> list[float]:
        """The measured cost of each loop iteration (its wait on the sockets excluded)."""
        return list(self._costs)

    def close(self) -> None:
        self.liveness.close()

    # -- registration and epoch 0 --------------------------------------------------------

    def _on_liveness(self, event: Hello | Gone) -> None:
        rank = (event.replica, event.group_rank)
        if event.replica < 0:  # a warm spare (its group rank is its spare id)
            if isinstance(event, Hello):
                self._spares[event.inc] = event.group_rank
                _log.info("warm spare %d connected (pid %d)", event.group_rank, event.pid)
            else:
                self._spares.pop(event.inc, None)
            return
        if isinstance(event, Hello):
            self._connected[rank] = event
            self._takeovers.pop(event.inc, None)
        elif rank in self._connected and self._connected[rank].inc == event.inc:
            del self._connected[rank]
        if isinstance(event, Hello):
            if self.epoch < 0 and event.replica < self.replicas and event.group_rank < self.nproc:
                self._registered[rank] = event
            return
        if self.epoch >= 0 and event.replica not in self.members:
            self._reopen(rank, event.inc, f"r{rank[0]}g{rank[1]} claimant (pid {event.pid}) died")
        if self.epoch < 0:
            if rank in self._registered and self._registered[rank].inc == event.inc:
                del self._registered[rank]  # died before the start; its restart registers again
            return
        member = self._ranks.get(rank)
        if member is not None and member.inc == event.inc and not member.dead:
            self._gone(rank, member, f"r{rank[0]}g{rank[1]} liveness EOF (pid {event.pid})")
        joiner = self.joiners.get(event.replica)
        joined = joiner.ranks.get(event.group_rank) if joiner is not None else None
        if joined is not None and joined.inc == event.inc:
            _log.info("joiner r%dg%d disconnected; registration dropped", *rank)
            del self.joiners[event.replica]
        adm = self.admission
        if (
            adm is not None
            and adm.joiner == event.replica
            and adm.incarnations.get(event.group_rank) == event.inc
            and not adm.cancelled
        ):
            adm.cancelled = f"joiner r{rank[0]}g{rank[1]} liveness EOF (pid {event.pid})"

    def _start(self, cause: str = "") -> None:
        now = time.monotonic()
        self._ranks = {
            rank: _Member(inc=h.inc, pid=h.pid, seen=now) for rank, h in self._registered.items()
        }
        self._registered.clear()
        t = time.time()
        self._publish(
            EpochRecord(
                epoch=self.epoch + 1,
                members=tuple(range(self.replicas)),
                reason="start",
                cause=cause,
                t_detect=t,
                t_publish=t,
                incarnations=self._incarnations(range(self.replicas)),
            )
        )

    def _restart(self) -> None:
        """The published epoch has no members (every one died, or fewer than
        ``min_replicas`` were left): start a fresh membership, as at epoch 0, once all R x N
        ranks are connected with incarnations that were never members (their restarts).

        Without it the restarted workers found an epoch naming dead incarnations, registered
        as joiners with no member left to heal them, and waited until ``join_timeout_s``.
        """
        fresh = {
            rank: hello
            for rank, hello in self._connected.items()
            if hello.inc not in self._retired
            and 0 <= rank[0] < self.replicas
            and rank[1] < self.nproc
        }
        if len(fresh) < self.replicas * self.nproc:
            return
        self._registered = fresh
        self.joiners.clear()
        self._pending, self.admission = None, None
        self._start(f"epoch {self.epoch} had no members; a fresh membership of the restarted ranks")

    # -- detection -----------------------------------------------------------------------

    def _read_heartbeats(self) -> None:
        ranks = [r for r, m in self._ranks.items() if not m.dead]
        if not ranks:
            return
        now = time.monotonic()
        raws = self.store.multi_get([self.keys.heartbeat(*r) for r in ranks])
        for rank, raw in zip(ranks, raws, strict=True):
            member = self._ranks[rank]
            if raw == member.raw:
                continue
            key = self.keys.heartbeat(*rank)
            try:
                hb = decode(Heartbeat, raw, key=key)
            except ValueError as exc:
                self._ignore(key, str(exc))
                continue
            if hb.inc != member.inc or hb.epoch < min(self._floor, self.epoch - 1):
                self._ignore(key, f"incarnation {hb.inc} at epoch {hb.epoch} is not a member")
                continue
            member.raw, member.seen, member.committed = raw, now, hb.committed
        newest = max((m.committed for m in self._ranks.values()), default=0)
        if not self._progress or self._progress[-1][1] != newest:
            self._progress.append((now, newest))
        for rank in ranks:
            member = self._ranks[rank]
            silent = now - member.seen
            if silent > self.config.lease_s:
                why = f"r{rank[0]}g{rank[1]} lease expired (no heartbeat for {silent:.2f} s)"
                self._gone(rank, member, why)

    def _gone(self, rank: Rank, member: _Member, why: str) -> None:
        """A member rank's socket closed or its lease expired: finished when it published
        ``done/`` first (no change; the run is over once every member finished), else lost
        (a change begins)."""
        done = [self.keys.done(e, *rank) for e in reversed(self._live_epochs())]
        found = next((k for k in done if self.store.check([k])), None)
        if found is None:
            member.dead = why
            if rank not in self._vacant:
                self._open(rank)  # its restart (or a spare) may register at once
            self._begin(why)
            return
        raw = self.store.get(found)
        try:
            member.finished = int(raw)
        except ValueError:
            self._ignore(found, f"not a step number: {raw[:40]!r}")
            member.dead = why
            self._begin(why)
            return
        member.dead = f"r{rank[0]}g{rank[1]} finished at step {member.finished}"
        _log.info("%s", member.dead)
        if self._pending is None and all(m.finished is not None for m in self._ranks.values()):
            self._finish()

    def _finish(self) -> None:
        """Every member rank finished: publish the ``"finished"`` epoch (no members). The
        coordinator then only beats; a replica restarted later is told the run is over."""
        last = max(m.finished or 0 for m in self._ranks.values())
        t = time.time()
        self._publish(
            EpochRecord(
                epoch=self.epoch + 1,
                members=(),
                reason="finished",
                cause=f"every member finished; the last committed step is {last}",
                resume_step=last,
                t_detect=t,
                t_publish=t,
            )
        )
        self.admission = None
        self.joiners.clear()

    @property
    def finished(self) -> bool:
        """Whether the run is over (the ``"finished"`` epoch is published)."""
        return bool(self.history) and self.history[-1].reason == "finished"

    def _live_epochs(self) -> range:
        """The epochs whose ``fail/`` and ``ack/`` keys count now (two during an admission)."""
        return range(min(self._floor, self.epoch), self.epoch + 1)

    def _check_failure_key(self) -> None:
        if self._pending is not None:
            return
        keys = [self.keys.failure(e) for e in self._live_epochs()]
        found = [k for k in keys if self.store.check([k])]
        if not found:
            return
        key = found[-1]
        try:
            failure = decode(Failure, self.store.get(key), key=key)
        except ValueError as exc:
            self._begin(f"{key} unreadable ({exc})")
            return
        incs = {m.inc for m in self._ranks.values()}
        if failure.by != "coordinator" and failure.inc not in incs:
            self._ignore(key, f"written by {failure.by} incarnation {failure.inc!r}, not a member")
            return
        self._begin(f"{key.removeprefix(self.keys.root)} by {failure.by}: {failure.reason}")
        if failure.reason == "leave" and self._pending is not None:
            self._pending.leave = True

    def _begin(self, cause: str) -> None:
        if self._pending is not None:
            self._pending.causes.append(cause)
            return
        _log.info("epoch %d failed: %s", self.epoch, cause)
        self._pending = _Pending(
            t_detect=time.time(),
            deadline=time.monotonic() + self.config.ack_timeout_s,
            causes=[cause],
        )
        flag = encode_text(Failure(by="coordinator", reason=cause, t=time.time()))
        for epoch in self._live_epochs():
            self.store.compare_set(self.keys.failure(epoch), "", flag)
        for member in self._ranks.values():  # they read the flag when poked (liveness.py)
            if not member.dead:
                self.liveness.poke(member.inc)

    # -- agreement -----------------------------------------------------------------------

    def _collect_acks(self) -> None:
        pending = self._pending
        assert pending is not None
        now = time.monotonic()
        waiting = False
        for rank, member in self._ranks.items():
            if rank in pending.acks or member.dead:
                continue
            key = self._ack_key(rank)
            if key is not None:
                try:
                    ack = decode(Ack, self.store.get(key), key=key)
                except ValueError as exc:
                    self._ignore(key, str(exc))
                    continue
                if ack.inc == member.inc:
                    pending.acks[rank] = ack
                    continue
                self._ignore(key, f"incarnation {ack.inc!r} is not a member")
            if now - member.seen <= self.config.stale_s:
                waiting = True  # alive and not acked yet
        if waiting and now < pending.deadline:
            return
        self._decide(pending)

    def _ack_key(self, rank: Rank) -> str | None:
        """The newest ``ack/<e>/<r>/<g>`` of the live epochs that exists, if any."""
        for epoch in reversed(self._live_epochs()):
            key = self.keys.ack(epoch, *rank)
            if self.store.check([key]):
                return key
        return None

    def _decide(self, pending: _Pending) -> None:
        survivors = tuple(
            r for r in self.members if all((r, g) in pending.acks for g in range(self.nproc))
        )
        if not survivors and any(m.finished is not None for m in self._ranks.values()):
            # A member finished (it committed the last step) while another was lost: the
            # run is over, not below min_replicas.
            self._pending = None
            self._end_admission()
            self._finish()
            return
        resume = max(
            (pending.acks[(r, g)].committed for r in survivors for g in range(self.nproc)),
            default=0,
        )
        cause = "; ".join(pending.causes)
        reason = "leave" if pending.leave else "lost"
        adm = self.admission
        if adm is not None:
            if survivors == self.members:
                reason = "admission cancelled"
            first = f"{adm.cancelled}; " if adm.cancelled else ""
            cause = (
                f"{first}{cause}; admission of replica {adm.joiner} (heal at step {adm.step}) ended"
            )
            self._end_admission()
        if len(survivors) < self.config.min_replicas:
            cause = (
                f"{len(survivors)} replica(s) {list(survivors)} left of {self.replicas}, "
                f"min_replicas={self.config.min_replicas}; {cause}"
            )
            survivors, reason = (), "below min_replicas"
        self._pending = None
        self._publish(
            EpochRecord(
                epoch=self.epoch + 1,
                members=survivors,
                reason=reason,
                cause=cause,
                resume_step=resume,
                t_detect=pending.t_detect,
                t_publish=time.time(),
                incarnations=self._incarnations(survivors),
            )
        )

    def _end_admission(self) -> None:
        """Forget the admission; a joiner still registered is scheduled again later."""
        adm, self.admission = self.admission, None
        if adm is not None and adm.joiner in self.joiners:
            self.joiners[adm.joiner].scheduled = False

    def _publish(self, record: EpochRecord, *, floor: int | None = None) -> None:
        # Every member finished: nothing is vacant (a restart is told the run is over).
        dropped = [
            r for r in self.members if r not in record.members and record.reason != "finished"
        ]
        for r in record.members:
            for g in range(self.nproc):
                self._vacant.pop((r, g), None)
            self._spare_for.discard(r)
            self._left.discard(r)
        for r in dropped:  # before the record: whoever sees r dropped can claim its ranks
            for g in range(self.nproc):
                if (r, g) not in self._vacant:  # not opened at its death already
                    self._open((r, g))
            if record.reason == "leave":
                self._left.add(r)  # on purpose: no spare takes its place
            elif record.members:
                self._spare_for.add(r)
        if dropped or record.reason == "finished":
            self._poke_spares()  # a spare of a dropped replica reclaims it; finished: exit
        # The record first, then the number: a worker that sees ``epoch`` can read the record.
        self.store.set(self.keys.epoch_record(record.epoch), encode_text(record))
        self.store.set(self.keys.epoch, str(record.epoch))
        self.epoch, self.members = record.epoch, record.members
        self._beat()  # the members' heartbeats see the new epoch at their next beat
        self._floor = record.epoch if floor is None else floor
        self._retired.update(m.inc for m in self._ranks.values())
        now = time.monotonic()
        self._ranks = {
            rank: _Member(inc=m.inc, pid=m.pid, seen=now, raw=m.raw, committed=m.committed)
            for rank, m in self._ranks.items()
            if rank[0] in record.members
        }
        self.history.append(
            Decision(
                epoch=record.epoch,
                members=record.members,
                reason=record.reason,
                cause=record.cause,
                t_detect=record.t_detect,
                t_publish=record.t_publish,
                resume_step=record.resume_step,
            )
        )
        _log.info(
            "epoch %d published: members %s, reason %r, resume_step %d, detect->publish %.1f ms%s",
            record.epoch,
            list(record.members),
            record.reason,
            record.resume_step,
            (record.t_publish - record.t_detect) * 1e3,
            f" ({record.cause})" if record.cause else "",
        )

    def _incarnations(self, replicas: object) -> dict[str, str]:
        chosen = set(replicas)  # type: ignore[call-overload]
        return {f"{r}/{g}": m.inc for (r, g), m in sorted(self._ranks.items()) if r in chosen}

    # -- vacancies and warm spares (docs/live-membership.md §6.3) --------------------------

    def _open(self, rank: Rank) -> None:
        self._opened += 1
        value = f"open:{self._opened}"
        self.store.set(self.keys.owner(*rank), value)
        self._vacant[rank] = value

    def _reopen(self, rank: Rank, inc: str, why: str) -> None:
        """Open ``rank`` again if ``inc`` (dead, or too slow) still holds its claim."""
        self._opened += 1
        value = f"open:{self._opened}"
        if self.store.compare_set(self.keys.owner(*rank), inc, value) == value.encode():
            self._vacant[rank] = value
            if rank[0] not in self._left and self.members:
                self._spare_for.add(rank[0])
            self._poke_spares()
            _log.info("r%dg%d vacant again: %s", rank[0], rank[1], why)

    def _poke_spares(self) -> None:
        for inc in list(self._spares):
            if not self.liveness.poke(inc):
                del self._spares[inc]

    def _assign_spares(self) -> None:
        """Hand each lost replica's vacancy to a waiting spare (N = 1: rank 0 only)."""
        for r in sorted(self._spare_for):
            if not self._spares:
                return
            rank = (r, 0)
            value = self._vacant.get(rank)
            if value is None or r in self.joiners or self.nproc != 1:
                self._spare_for.discard(r)
                continue
            inc = uuid.uuid4().hex
            got = self.store.compare_set(self.keys.owner(*rank), value, inc)
            self._spare_for.discard(r)
            del self._vacant[rank]
            if got != inc.encode():
                continue  # a restarted worker claimed it first: it is the joiner
            spare_inc, sid = min(self._spares.items(), key=lambda item: item[1])
            del self._spares[spare_inc]
            t = time.time()
            self.store.set(self.keys.spare_take(sid), encode_text(Takeover(r, inc, t)))
            self._takeovers[inc] = (rank, time.monotonic() + self.config.coordinator_timeout_s)
            self.takeovers.append((r, sid, t))
            self.liveness.poke(spare_inc)
            _log.info("warm spare %d takes over replica %d (incarnation %s)", sid, r, inc)

    def _expire_takeovers(self) -> None:
        now = time.monotonic()
        for inc, (rank, deadline) in list(self._takeovers.items()):
            if now > deadline:
                del self._takeovers[inc]
                self._reopen(rank, inc, f"the spare given it said no hello within "
                             f"{self.config.coordinator_timeout_s:g} s")  # fmt: skip

    # -- joiners -------------------------------------------------------------------------

    def _register_joiners(self) -> None:
        for r in range(self.replicas):
            if r in self.members:
                continue
            for g in range(self.nproc):
                key = self.keys.join(r, g)
                if not self.store.check([key]):
                    continue
                raw = self.store.get(key)
                try:
                    join = decode(Join, raw, key=key)
                except ValueError as exc:
                    self._ignore(key, str(exc))
                    continue
                hello = self._connected.get((r, g))
                if hello is None or hello.inc != join.inc:
                    continue  # a dead incarnation's record: its restart writes a new one
                joiner = self.joiners.setdefault(r, Joiner(r, registered_at=time.time()))
                if joiner.ranks.get(g) != join:
                    okey = self.keys.owner(r, g)
                    owner = self.store.get(okey).decode() if self.store.check([okey]) else ""
                    if owner != join.inc:  # a claim that was reopened (a spare too slow)
                        self._ignore(key, f"incarnation {join.inc} does not hold the claim")
                        if not joiner.ranks:
                            del self.joiners[r]
                        continue
                    joiner.ranks[g] = join
                    _log.info("replica %d rank %d registered as joining (pid %d)", r, g, join.pid)
            joiner_ = self.joiners.get(r)
            if (
                joiner_ is not None
                and len(joiner_.ranks) == self.nproc
                and not joiner_.scheduled
                and self._pending is None
                and self.admission is None
            ):
                joiner_.scheduled = True
                self.schedule_admission(joiner_)

    def heal_step(self) -> int:
        """h for an admission scheduled now: the newest committed step plus a margin.

        The margin is 2 steps (one to read the record from the heartbeat cache, one in
        flight) plus the steps the members make, at the commit rate the heartbeats showed
        over the last seconds, in 4 heartbeat periods: the coordinator's view of ``committed``
        and the members' view of the record each lag by up to a heartbeat period (x2 for
        slack). Steps faster than the heartbeat would otherwise pass h before the record
        arrives.
        """
        newest = max((m.committed for m in self._ranks.values() if not m.dead), default=0)
        rate = 0.0
        if len(self._progress) >= 2:
            (t0, c0), (t1, c1) = self._progress[0], self._progress[-1]
            if t1 > t0:
                rate = (c1 - c0) / (t1 - t0)
        return newest + 2 + math.ceil(rate * 4 * self.config.heartbeat_s)

    def schedule_admission(self, joiner: Joiner) -> None:
        """All N ranks of ``joiner`` registered: schedule its heal (docs/live-membership.md §6.2).

        Writes ``epoch/<E+1>``: members unchanged, ``reason="admit"``, ``heal={joiner,
        donor (the lowest member id), step h}``, and the joiner's incarnations beside the
        members' (the joiner is named, not admitted).
        """
        donor = min(self.members)
        step = self.heal_step()
        asked = max((j.at_step for j in joiner.ranks.values()), default=0)
        newest = max((m.committed for m in self._ranks.values() if not m.dead), default=0)
        if asked:
            if asked >= newest:
                step = asked  # a scripted join@R:S: the members wait for it after S - 1
            else:
                _log.warning("replica %d asked to be healed at step %d, but the members "
                             "committed step %d already; healing at step %d", joiner.replica,
                             asked, newest, step)  # fmt: skip
        incs = {g: j.inc for g, j in joiner.ranks.items()}
        base = self.epoch
        t = time.time()
        record = EpochRecord(
            epoch=base + 1,
            members=self.members,
            reason="admit",
            cause=f"replica {joiner.replica} healed from replica {donor} at step {step}",
            resume_step=step,
            t_detect=t,
            t_publish=t,
            heal={"joiner": joiner.replica, "donor": donor, "step": step},
            incarnations={
                **self._incarnations(self.members),
                **{f"{joiner.replica}/{g}": inc for g, inc in sorted(incs.items())},
            },
        )
        self.admission = Admission(
            joiner=joiner.replica,
            donor=donor,
            step=step,
            base_epoch=base,
            admit_epoch=base + 1,
            incarnations=incs,
            t_scheduled=time.monotonic(),
        )
        self._publish(record, floor=base)

    def _check_admission(self) -> None:
        adm = self.admission
        assert adm is not None
        now = time.monotonic()
        joining = [(adm.joiner, g) for g in range(self.nproc)]
        if not adm.cancelled:  # the joiner's lease (a SIGSTOPped joiner cancels)
            raws = self.store.multi_get([self.keys.heartbeat(*r) for r in joining])
            for (r, g), raw in zip(joining, raws, strict=True):
                last = adm.beats.get(g)
                if last is None or last[0] != raw:
                    adm.beats[g] = (raw, now)
                elif now - last[1] > self.config.lease_s:
                    adm.cancelled = (
                        f"joiner r{r}g{g} lease expired (no heartbeat for {now - last[1]:.2f} s)"
                    )
        for r, g in joining:
            if adm.cancelled or g in adm.digests:
                continue
            key = self.keys.ack(adm.admit_epoch, r, g)
            if not self.store.check([key]):
                continue
            try:
                ack = decode(Ack, self.store.get(key), key=key)
            except ValueError as exc:
                adm.cancelled = f"joiner r{r}g{g}: {exc}"
                continue
            if ack.inc != adm.incarnations[g]:
                self._ignore(key, f"incarnation {ack.inc!r} is not the joiner's")
            elif ack.error or not ack.digest:
                adm.cancelled = f"joiner r{r}g{g}: heal failed: {ack.error or 'no digest'}"
            else:
                adm.digests[g] = ack.digest
        if any(m.committed < adm.step for m in self._ranks.values()):
            return  # members are still stepping towards h (in epoch E)
        if adm.cancelled:
            self._conclude(adm, self.members, "admission cancelled", adm.cancelled)
        elif len(adm.digests) == self.nproc:
            members = tuple(sorted((*self.members, adm.joiner)))
            digests = ", ".join(f"g{g}={d}" for g, d in sorted(adm.digests.items()))
            cause = f"replica {adm.joiner} healed from replica {adm.donor} at step {adm.step}"
            self._conclude(adm, members, "admitted", f"{cause} ({digests})")

    def _conclude(self, adm: Admission, members: tuple[int, ...], reason: str, cause: str) -> None:
        joiner = self.joiners.get(adm.joiner)
        if reason == "admitted":
            assert joiner is not None
            for g, j in joiner.ranks.items():
                self._ranks[(adm.joiner, g)] = _Member(
                    inc=j.inc, pid=j.pid, seen=time.monotonic(), committed=adm.step
                )
            del self.joiners[adm.joiner]
            self.admission = None
        else:
            self._end_admission()
        t = time.time()
        self._publish(
            EpochRecord(
                epoch=self.epoch + 1,
                members=members,
                reason=reason,
                cause=cause,
                resume_step=adm.step,
                t_detect=t,
                t_publish=t,
                incarnations=self._incarnations(members),
            )
        )

    def _ignore(self, key: str, why: str) -> None:
        if (key, why) not in self._ignored:  # log each fenced writer once
            self._ignored.add((key, why))
            _log.info("ignored %s: %s", key, why)

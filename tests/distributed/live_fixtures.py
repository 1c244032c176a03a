"""Test-side stand-ins for the live-membership coordinator and the worker's membership view.

Until ``live.coordinator`` and ``live.membership.Membership`` land, these drive the real
coordinator protocol (``live.keys`` keys and records on a real ``TCPStore``):

* :class:`ScriptedCoordinator` is a **test driver**, not the product: a thread of the test
  process that hosts the store, admits the replicas that registered (``join/<r>/0``) as
  epoch 0, and on a failure (``fail/<E>``, or a registered pid that died: a stand-in for
  the liveness socket's EOF) collects ``ack/<E>/*`` until every member acked or is dead,
  then writes ``epoch/<E+1>`` (members: those that acked; ``resume_step``: the newest
  ``committed`` among them) and then ``epoch``. The real coordinator replaces it.
* :class:`StoreView` implements ``live.view.MembershipView`` over that store: one store
  client per thread, ``failed()`` is one ``check``, ``report_failure`` a ``compare_set``
  from absent, ``reform`` writes the ack and polls (bounded) for the next record.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from lm_resiliency.live.keys import Ack, EpochRecord, Failure, Join, Keys, decode, encode
from lm_resiliency.live.view import CoordinatorLost, Evicted

HOST = "127.0.0.1"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ScriptedCoordinator:
    """The test's coordinator driver; see the module doc. Start with ``start()``."""

    def __init__(self, run: str, replicas: int, *, ack_wait_s: float = 20.0) -> None:
        self.keys = Keys(run)
        self.replicas = replicas
        self.ack_wait_s = ack_wait_s
        self.store = dist.TCPStore(HOST, 0, 1, is_master=True, wait_for_workers=False)
        self.port = self.store.port
        self.records: list[EpochRecord] = []
        self.changes: list[dict[str, float]] = []
        """Per change: ``t_fail_seen`` and ``t_publish`` (``time.time()``)."""
        self.error: BaseException | None = None
        self._gone: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-coordinator", daemon=True)

    def start(self) -> ScriptedCoordinator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def _loop(self) -> None:
        store = self.store.clone()
        k = self.keys
        joins = [k.join(r, 0) for r in range(self.replicas)]
        while not store.check(joins):
            if self._stop.wait(0.01):
                return
        pids = {
            r: decode(Join, store.get(k.join(r, 0)), key=k.join(r, 0)).pid
            for r in range(self.replicas)
        }
        members = tuple(range(self.replicas))
        self._publish(store, EpochRecord(0, members, "start", t_publish=time.time()))
        epoch = 0
        while not self._stop.wait(0.01):
            dead = [r for r in members if not _alive(pids[r])]
            if not store.check([k.failure(epoch)]):
                if not dead:
                    continue
                failure = Failure(by="coordinator", reason=f"replica {dead} died", t=time.time())
                store.compare_set(k.failure(epoch), "", encode(failure))
            t_seen = time.time()
            deadline = time.monotonic() + self.ack_wait_s
            acks: dict[int, Ack] = {}
            while time.monotonic() < deadline:
                for r in members:
                    key = k.ack(epoch, r, 0)
                    if r not in acks and store.check([key]):
                        acks[r] = decode(Ack, store.get(key), key=key)
                if all(r in acks or not _alive(pids[r]) for r in members):
                    break
                time.sleep(0.005)
            members = tuple(sorted(acks))
            resume = max((a.committed for a in acks.values()), default=0)
            epoch += 1
            record = EpochRecord(
                epoch,
                members,
                "lost",
                cause=f"replicas {sorted(set(pids) - set(members) - self._gone)} lost",
                resume_step=resume,
                t_detect=t_seen,
                t_publish=time.time(),
            )
            self._gone |= set(pids) - set(members)
            self._publish(store, record)
            self.changes.append({"t_fail_seen": t_seen, "t_publish": record.t_publish})

    def _publish(self, store: dist.Store, record: EpochRecord) -> None:
        store.set(self.keys.epoch_record(record.epoch), encode(record))
        store.set(self.keys.epoch, str(record.epoch))
        self.records.append(record)


class StoreView:
    """``MembershipView`` over the coordinator store (the test's stand-in for ``Membership``)."""

    def __init__(
        self,
        port: int,
        run: str,
        replica: int,
        replicas: int,
        *,
        reform_timeout_s: float = 30.0,
    ) -> None:
        self._keys = Keys(run)
        self._port = port
        self._replica = replica
        self._replicas = replicas
        self._incarnation = uuid.uuid4().hex
        self.reform_timeout_s = reform_timeout_s
        self._local = threading.local()
        join = Join(inc=self._incarnation, host=HOST, pid=os.getpid())
        self.store().set(self._keys.join(replica, 0), encode(join))
        record = self._poll_record(0, self.reform_timeout_s)
        self._epoch = record.epoch
        self._members = record.members
        self.record = record

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
    def incarnation(self) -> str:
        return self._incarnation

    @property
    def group_rank(self) -> int:
        return 0

    def store(self) -> dist.Store:
        client = getattr(self._local, "store", None)
        if client is None:
            client = dist.TCPStore(HOST, self._port, is_master=False, wait_for_workers=False)
            self._local.store = client
        return client

    def failed(self) -> str | None:
        key = self._keys.failure(self._epoch)
        store = self.store()
        if not store.check([key]):
            return None
        return decode(Failure, store.get(key), key=key).reason

    def report_failure(self, reason: str) -> None:
        failure = Failure(by=f"r{self._replica}g0", reason=reason, t=time.time())
        self.store().compare_set(self._keys.failure(self._epoch), "", encode(failure))

    def reform(self, ack: Ack) -> EpochRecord:
        self.store().set(self._keys.ack(self._epoch, self._replica, 0), encode(ack))
        record = self._poll_record(self._epoch + 1, self.reform_timeout_s)
        if self._replica not in record.members:
            raise Evicted(record.epoch, record.reason)
        self._epoch = record.epoch
        self._members = record.members
        self.record = record
        return record

    def _poll_record(self, epoch: int, timeout_s: float) -> EpochRecord:
        key = self._keys.epoch_record(epoch)
        store = self.store()
        deadline = time.monotonic() + timeout_s
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise CoordinatorLost(f"no record {key!r} within {timeout_s} s")
            time.sleep(0.002)
        return decode(EpochRecord, store.get(key), key=key)

"""The vacancy and warm-spare protocol against a real coordinator (docs/live-membership.md §6.3).

The coordinator's decision loop runs on a thread of the test over a real ``TCPStore``; the
members, the spares and the restarted workers are real :class:`Membership` and
:class:`Spare` objects (their own store clients, liveness sockets and heartbeat threads).
A member "dies" by closing its membership: its liveness socket closes, as a SIGKILL's would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.coordinator import Coordinator
from lm_resiliency.live.keys import OPEN, Ack, Keys
from lm_resiliency.live.membership import Membership
from lm_resiliency.live.spare import Spare, Taken
from lm_resiliency.live.view import ReplicaTaken
from lm_resiliency.testing.torchrun import free_port

_RUN = "spare-proto"
# A spare that says no hello as its replica within coordinator_timeout_s loses the vacancy:
# the tests register the spare they were given at once, and 5 s leaves a loaded machine room.
_CONFIG = LiveConfig(heartbeat_s=0.2, lease_s=5.0, stale_s=2.5, coordinator_timeout_s=5.0,
                     join_timeout_s=30.0)  # fmt: skip


class Job:
    def __init__(self, replicas: int) -> None:
        self.port = free_port()
        timeout = timedelta(seconds=10)
        server = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                               timeout=timeout)  # fmt: skip
        # The coordinator's thread owns the server's client; the test reads through its own.
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timeout)
        self.keys = Keys(_RUN)
        self.coordinator = Coordinator(server, self.keys, replicas=replicas, nproc_per_group=1,
                                       config=_CONFIG, host="127.0.0.1")  # fmt: skip
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.coordinator.run, args=(self.stop,))
        self.thread.start()
        self.env = {"LMR_LIVE_COORDINATOR": f"127.0.0.1:{self.port}", "LMR_LIVE_RUN": _RUN,
                    "LMR_REPLICA_GROUPS": str(replicas), "RANK": "0"}  # fmt: skip
        self.open: list[Membership | Spare] = []

    def member(self, replica: int, inc: str = "") -> Membership:
        env = {**self.env, "LMR_REPLICA_GROUP": str(replica)}
        m = Membership.from_env(_CONFIG, env, incarnation=inc)
        self.open.append(m)
        return m

    def spare(self, own: int | None = None) -> Spare:
        s = Spare(_CONFIG, self.env, own=own)
        s.connect()
        self.open.append(s)
        return s

    def owner(self, replica: int) -> str:
        key = self.keys.owner(replica, 0)
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def wait(self, what: str, cond, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            time.sleep(0.02)

    def close(self) -> None:
        for o in self.open:
            o.close()
        self.stop.set()
        self.thread.join(10)
        self.coordinator.close()


@pytest.fixture
def job() -> Iterator[Job]:
    j = Job(3)
    yield j
    j.close()


def _start(job: Job, replicas: int) -> list[Membership]:
    with ThreadPoolExecutor(replicas) as pool:  # registration waits for every rank
        return list(pool.map(job.member, range(replicas)))


def _lose(job: Job, members: list[Membership], lost: int) -> None:
    """Close replica ``lost`` (its socket EOF) and let the others reform to the next epoch."""
    members[lost].close()
    survivors = [m for i, m in enumerate(members) if i != lost]
    with ThreadPoolExecutor(len(survivors)) as pool:
        list(pool.map(lambda m: m.reform(Ack(inc="", committed=0)), survivors))


def _taken(spare: Spare, timeout_s: float = 10.0) -> Taken:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = spare.poll(0.5)
        if got is not None:
            return got
    raise AssertionError("the spare was given no replica")


@pytest.mark.timeout(120)
def test_a_lost_replica_goes_to_the_spare_and_its_restart_finds_it_taken(job: Job) -> None:
    members = _start(job, 3)
    spare = job.spare()
    job.wait("the spare's hello", lambda: job.coordinator._spares)
    _lose(job, members, 1)
    taken = _taken(spare)
    assert taken.replica == 1 and job.owner(1) == taken.inc
    assert [r for r, _, _ in job.coordinator.takeovers] == [1]
    spare.close()
    joiner = job.member(1, inc=taken.inc)  # the spare registers as the replica's joiner
    assert joiner.joining
    job.wait("the joiner's registration", lambda: 1 in job.coordinator.joiners)
    # The killed worker's torchrun restarts it (seconds later): it must not register as 1.
    with pytest.raises(ReplicaTaken, match="replica 1 rank 0 was taken over"):
        job.member(1)


@pytest.mark.timeout(120)
def test_a_restart_that_claims_first_is_the_joiner_and_no_spare_is_used(job: Job) -> None:
    members = _start(job, 3)
    members[2].close()  # dies; the vacancy opens at its death, before the change is published
    job.wait("the vacancy", lambda: job.owner(2).startswith(OPEN))
    restarted = job.member(2)  # claims it while the change is still under way
    assert restarted.joining and job.owner(2) == restarted.incarnation
    spare = job.spare()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda m: m.reform(Ack(inc="", committed=0)), members[:2]))
    job.wait("the joiner's registration", lambda: 2 in job.coordinator.joiners)
    assert spare.poll(0.5) is None and job.coordinator.takeovers == []


@pytest.mark.timeout(120)
def test_a_spare_too_slow_to_say_hello_loses_the_vacancy_to_the_next(job: Job) -> None:
    members = _start(job, 3)
    slow = job.spare()  # given the replica, but never registers as it
    job.wait("the spare's hello", lambda: job.coordinator._spares)
    _lose(job, members, 0)
    first = _taken(slow)
    job.wait("the vacancy reopened", lambda: job.owner(0).startswith(OPEN),
             timeout_s=3 * _CONFIG.coordinator_timeout_s)  # fmt: skip
    second = _taken(job.spare())
    assert second.replica == 0 and second.inc != first.inc
    job.member(0, inc=second.inc)  # this one registers at once: the claim stays
    assert job.owner(0) == second.inc
    with pytest.raises(ReplicaTaken):  # the slow one wakes up: fenced by the claim
        job.member(0, inc=first.inc)


@pytest.mark.timeout(120)
def test_a_worker_whose_replica_was_taken_reclaims_it_when_it_is_vacant_again(job: Job) -> None:
    members = _start(job, 3)
    spare = job.spare()
    job.wait("the spare's hello", lambda: job.coordinator._spares)
    _lose(job, members, 1)
    taken = _taken(spare)
    spare.close()
    holder = job.member(1, inc=taken.inc)
    job.wait("the joiner's registration", lambda: 1 in job.coordinator.joiners)
    with pytest.raises(ReplicaTaken):
        job.member(1)
    converted = job.spare(own=1)  # the restarted worker waits as a spare of its own replica
    holder.close()  # the spare that took replica 1 dies before it was admitted
    back = _taken(converted)
    assert back.replica == 1 and job.owner(1) == back.inc

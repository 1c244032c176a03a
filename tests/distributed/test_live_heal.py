"""Heal and rejoin (docs/live-membership.md §6) with a real coordinator and real replicas.

The coordinator runs through ``lm-resiliency coordinator``; each replica is one
``heal_worker.py`` process (a linear model trained data-parallel over a real cross-replica
``ProcessGroupGloo``, the sampler's global batch split over the members). Replica 1 dies at
the kill point ``live.forward@5`` (before its all-reduce of step 5, so no survivor commits
step 5 without it) and is restarted as a new process, as its torchrun would. The heal kill
points ``live.heal_send``/``live.heal_recv`` fire once half the state is on the wire.

Checked in every case: the survivors' PIDs never change (one process each), each process's
commit log has no skipped or repeated step, every committed step's samples are the global
batch exactly once across its members, every replica's digest is equal at every step it
committed, and the records of the coordinator tell the story (reasons, members, heal step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_live_coordinator import _RUN, LiveJob

from lm_resiliency.live.keys import EpochRecord, Keys, decode
from lm_resiliency.live.sampler import global_indices

pytestmark = pytest.mark.slow

_WORKER = Path(__file__).with_name("heal_worker.py")
_STEPS = 24
_CONFIG = {"heartbeat_s": 0.2, "lease_s": 20.0, "stale_s": 5.0, "coordinator_timeout_s": 20.0,
           "reform_timeout_s": 30.0, "poll_slice_s": 0.01, "heal_timeout_s": 20.0,
           "pg_timeout_s": 20.0}  # fmt: skip


_COORDINATOR_FLAGS = ("heartbeat_s", "lease_s", "stale_s", "coordinator_timeout_s",
                      "reform_timeout_s")  # fmt: skip


class HealJob(LiveJob):
    """R replicas of one rank; ``restart`` starts a new process (a new incarnation) for one."""

    def __init__(self, tmp: Path, replicas: int, kills: dict[int, str]) -> None:
        self.kills = dict(kills)
        self.starts: dict[int, int] = defaultdict(int)
        self.history: dict[int, list[subprocess.Popen[bytes]]] = defaultdict(list)
        coordinator = {k: v for k, v in _CONFIG.items() if k in _COORDINATOR_FLAGS}
        super().__init__(tmp, replicas, 1, coordinator)

    def _file(self, r: int, k: int) -> Path:
        return self.tmp / f"r{r}.{k}.out"

    def _start_worker(self, r: int, g: int) -> None:
        k = self.starts[r]
        self.starts[r] += 1
        env = {
            **os.environ,
            "LMR_LIVE_COORDINATOR": f"127.0.0.1:{self.address['port']}",
            "LMR_LIVE_RUN": _RUN,
            "LMR_REPLICA_GROUP": str(r),
            "LMR_REPLICA_GROUPS": str(self.replicas),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LIVE_TEST_CONFIG": json.dumps(_CONFIG),
            "HEAL_TEST_STEPS": str(_STEPS),
            "HEAL_TEST_CHUNK": str(1 << 14),  # 256 KiB of state in 16 chunks
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("LM_RESILIENCY_TEST_KILL", None)
        if r in self.kills:
            env["LM_RESILIENCY_TEST_KILL"] = self.kills.pop(r)
        with open(self._file(r, k), "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(_WORKER)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.workers[(r, 0)] = proc
        self.history[r].append(proc)

    def restart(self, r: int, kill: str | None = None) -> None:
        """Start replica r again once its process is gone (what its torchrun does)."""
        assert self.exit_code(r, 0) == -9  # SIGKILLed by its kill point
        if kill is not None:
            self.kills[r] = kill
        self._start_worker(r, 0)

    def events(
        self, r: int, g: int = 0, kind: str | None = None, k: int = -1
    ) -> list[dict[str, Any]]:
        k = self.starts[r] - 1 if k < 0 else k
        lines = self._file(r, k).read_text(errors="replace").splitlines()
        found = [json.loads(x) for x in lines if x.startswith('{"event"')]
        return [e for e in found if kind is None or e["event"] == kind]

    def output(self, r: int, g: int = 0) -> str:
        return "".join(self._file(r, k).read_text(errors="replace")[-3000:]
                       for k in range(self.starts[r]))  # fmt: skip

    def done(self, r: int) -> dict[str, Any]:
        (event,) = self.wait_for(lambda: self.events(r, 0, "done"), f"replica {r} done")
        assert self.exit_code(r, 0) == 0, self.output(r)
        return event

    def records(self) -> list[EpochRecord]:
        """The epochs published before the first replica finished (its exit is a loss too)."""
        end = min(e["t"] for r in self.starts for e in self.events(r, 0, "done"))
        return [r for r in self._all_records() if r.t_publish < end]

    def _all_records(self) -> list[EpochRecord]:
        store, keys = self.store(), Keys(_RUN)
        last = int(store.get(keys.epoch))
        return [
            decode(EpochRecord, store.get(keys.epoch_record(e)), key="epoch")
            for e in range(last + 1)
        ]

    def commits(self) -> dict[tuple[int, int], list[dict[str, Any]]]:
        """(replica, start) -> that process's commit events."""
        return {(r, k): self.events(r, 0, "commit", k) for r in self.starts
                for k in range(self.starts[r])}  # fmt: skip


@pytest.fixture
def heal_job(tmp_path: Path) -> Iterator[Callable[..., HealJob]]:
    jobs: list[HealJob] = []

    def start(replicas: int, kills: dict[int, str]) -> HealJob:
        job = HealJob(tmp_path, replicas, kills)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()
        for procs in job.history.values():  # every incarnation is gone
            assert all(p.poll() is not None for p in procs)


def _check_logs(job: HealJob) -> dict[int, str]:
    """The invariants over every process's commit log; returns step -> the common digest."""
    by_step: dict[int, dict[tuple[int, int], dict[str, Any]]] = defaultdict(dict)
    for proc, commits in job.commits().items():
        steps = [c["step"] for c in commits]
        if steps:  # consecutive: nothing skipped, nothing repeated
            assert steps == list(range(steps[0], steps[0] + len(steps))), (proc, steps)
        for c in commits:
            by_step[c["step"]][proc] = c
    digests = {}
    for step, entries in sorted(by_step.items()):
        assert len({c["digest"] for c in entries.values()}) == 1, (step, entries)
        digests[step] = next(iter(entries.values()))["digest"]
        members = {tuple(c["members"]) for c in entries.values()}
        assert len(members) == 1, (step, members)
        (mem,) = members
        assert sorted(r for r, _ in entries) == list(mem), (step, entries.keys(), mem)
        ids = sorted(i for c in entries.values() for i in c["ids"])
        assert ids == sorted(global_indices(1234, step, 96, 12)), step
    return digests


def _survivors_kept_their_pids(job: HealJob, *replicas: int) -> None:
    for r in replicas:
        assert job.starts[r] == 1  # one process for the whole run


@pytest.mark.timeout(420)
def test_a_killed_replica_rejoins_healed_and_the_world_is_full_again(heal_job) -> None:
    job = heal_job(3, {1: "live.forward@5"})
    job.restart(1)
    done = {r: job.done(r) for r in (0, 1, 2)}
    _survivors_kept_their_pids(job, 0, 2)
    assert len({d["digest"] for d in done.values()}) == 1
    assert all(d["finite"] for d in done.values())
    assert {tuple(d["members"]) for d in done.values()} == {(0, 1, 2)}
    records = job.records()
    assert [r.reason for r in records] == ["start", "lost", "admit", "admitted"]
    lost, admit, admitted = records[1:]
    assert lost.members == (0, 2) and lost.resume_step == 4
    assert admit.members == (0, 2) and admit.heal is not None
    assert admit.heal["joiner"] == 1 and admit.heal["donor"] == 0
    h = admit.heal["step"]
    assert admitted.members == (0, 1, 2) and admitted.resume_step == h
    (healed,) = job.events(1, 0, "healed")
    assert healed["step"] == h and healed["nbytes"] == 2 * 4 * 32768
    digests = _check_logs(job)
    assert healed["digest"] == digests[h]  # the joiner loaded the members' state at h
    joiner_steps = [c["step"] for c in job.events(1, 0, "commit")]
    assert joiner_steps[0] == h + 1  # it computes from h+1 on, with everyone
    assert max(digests) >= _STEPS
    print(f"\nheal of {healed['nbytes']} bytes at step {h}: {healed['seconds'] * 1e3:.1f} ms")


@pytest.mark.timeout(420)
def test_the_sender_killed_mid_heal_the_next_donor_heals_the_joiner(heal_job) -> None:
    job = heal_job(3, {1: "live.forward@5", 0: "live.heal_send"})
    job.restart(1)
    job.wait_for(lambda: job.events(1, 0, "healed"), "replica 1 healed by the next donor")
    job.restart(0)  # the dead donor comes back too, and is healed in its turn
    done = {r: job.done(r) for r in (0, 1, 2)}
    _survivors_kept_their_pids(job, 2)
    assert len({d["digest"] for d in done.values()}) == 1
    assert all(d["finite"] for d in done.values())
    records = job.records()
    reasons = [r.reason for r in records]
    assert reasons[:4] == ["start", "lost", "admit", "lost"], reasons
    assert records[2].heal is not None and records[2].heal["donor"] == 0
    assert records[3].members == (2,)  # without the donor, still without the joiner
    assert "r0g0 liveness EOF" in records[3].cause
    assert records[3].resume_step == records[2].heal["step"]
    # Replica 1 stayed registered and was healed by the next donor, then replica 0.
    admits = [r for r in records[4:] if r.reason == "admit"]
    assert admits[0].heal is not None and admits[0].heal["joiner"] == 1
    assert admits[0].heal["donor"] == 2
    assert records[-1].reason == "admitted" and records[-1].members == (0, 1, 2)
    # The first joiner process of replica 1 saw its receive fail, and was then healed.
    assert len(job.events(1, 0, "healed")) == 1
    assert job.starts[1] == 2
    _check_logs(job)


@pytest.mark.timeout(420)
def test_the_receiver_killed_mid_heal_cancels_the_admission(heal_job) -> None:
    job = heal_job(3, {1: "live.forward@5"})
    job.restart(1, kill="live.heal_recv")
    job.wait_for(lambda: job.workers[(1, 0)].poll() is not None, "the joiner dying mid-heal")
    job.restart(1)  # its torchrun starts it once more: healed this time
    done = {r: job.done(r) for r in (0, 1, 2)}
    _survivors_kept_their_pids(job, 0, 2)
    assert len({d["digest"] for d in done.values()}) == 1
    assert all(d["finite"] for d in done.values())
    records = job.records()
    reasons = [r.reason for r in records]
    assert reasons == ["start", "lost", "admit", "admission cancelled", "admit", "admitted"]
    admit, cancelled = records[2], records[3]
    assert admit.heal is not None
    h = admit.heal["step"]
    assert cancelled.members == admit.members == (0, 2)  # members unchanged
    assert cancelled.resume_step == h
    assert "joiner r1g0" in cancelled.cause
    # State unchanged by the cancelled heal: the members went on from h with h's state,
    # through the same step sequence (checked by the logs), and the final heal is later.
    assert records[4].heal is not None and records[4].heal["step"] > h
    _check_logs(job)
    assert not job.events(1, 0, "healed", k=1)

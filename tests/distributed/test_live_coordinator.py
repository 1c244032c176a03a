"""The live coordinator (started through ``lm-resiliency coordinator``) with real worker
processes holding ``Membership``s: real SIGKILL, SIGSTOP/SIGCONT, and a killed coordinator.

The workers are plain Python processes (``live_worker.py``, no process group). Replica r
commits step ``100 + 7 r`` so that the resume step names the survivors. Timings that a test
is not about are generous (2 cores shared by several sessions); latencies are printed, never
asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import Ack, EpochRecord, Keys, decode
from lm_resiliency.live.membership import Membership
from lm_resiliency.live.view import CoordinatorLost

_WORKER = Path(__file__).with_name("live_worker.py")
_RUN = "live-test"
_WAIT_S = 90.0  # bound of every wait on a process (generous: the machine is shared)
# Generous: no healthy worker may lose its lease to a starved CPU here.
_CALM = {"heartbeat_s": 0.2, "lease_s": 20.0, "stale_s": 5.0, "coordinator_timeout_s": 20.0,
         "reform_timeout_s": 30.0, "poll_slice_s": 0.02}  # fmt: skip


def _committed(replica: int) -> int:
    return 100 + 7 * replica


class LiveJob:
    """A coordinator process and R x N worker processes; every process is reaped at close."""

    def __init__(
        self,
        tmp: Path,
        replicas: int,
        nproc: int,
        config: dict[str, float],
        *coord_args: str,
        ack_delay: dict[int, float] | None = None,
    ) -> None:
        self.tmp, self.replicas, self.nproc, self.config = tmp, replicas, nproc, config
        self.workers: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.ack_delay: dict[int, float] = dict(ack_delay or {})
        ready = tmp / "coord.ready"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in config.items() if k != "poll_slice_s"]
        self.coord_log = tmp / "coord.log"
        with open(self.coord_log, "wb") as log:
            self.coordinator = subprocess.Popen(
                [sys.executable, "-m", "lm_resiliency.cli", "coordinator", "--port", "0",
                 "--run-id", _RUN, "--replica-groups", str(replicas), "--nproc-per-group",
                 str(nproc), "--ready-file", str(ready), *flags, *coord_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.wait_for(ready.exists, "the coordinator's ready file")
        self.address = json.loads(ready.read_text())
        for r in range(replicas):
            for g in range(nproc):
                self._start_worker(r, g)
        for rank in self.workers:
            self.wait_for(lambda rank=rank: self.events(*rank, "ready"), f"worker {rank} ready")

    def _start_worker(self, r: int, g: int) -> None:
        env = {
            **os.environ,
            "LMR_LIVE_COORDINATOR": f"127.0.0.1:{self.address['port']}",
            "LMR_LIVE_RUN": _RUN,
            "LMR_REPLICA_GROUP": str(r),
            "LMR_REPLICA_GROUPS": str(self.replicas),
            "RANK": str(g),
            "WORLD_SIZE": str(self.nproc),
            "LIVE_TEST_CONFIG": json.dumps(self.config),
            "LIVE_TEST_COMMITTED": str(_committed(r)),
            "LIVE_TEST_ACK_DELAY_S": str(self.ack_delay.get(r, 0.0)),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        out = open(self.tmp / f"w{r}g{g}.out", "wb")  # noqa: SIM115 - the child holds it
        with out:
            self.workers[(r, g)] = subprocess.Popen(
                [sys.executable, str(_WORKER)], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def events(self, r: int, g: int, kind: str | None = None) -> list[dict[str, Any]]:
        lines = (self.tmp / f"w{r}g{g}.out").read_text(errors="replace").splitlines()
        found = [json.loads(x) for x in lines if x.startswith('{"event"')]
        return [e for e in found if kind is None or e["event"] == kind]

    def output(self, r: int, g: int) -> str:
        return (self.tmp / f"w{r}g{g}.out").read_text(errors="replace")

    def wait_for(self, ok: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            value = ok()
            if value:
                return value
            time.sleep(0.02)
        logs = "\n".join(f"--- {r} ---\n{self.output(*r)[-2000:]}" for r in self.workers)
        raise AssertionError(
            f"timed out waiting for {what}\n--- coordinator ---\n"
            f"{self.coord_log.read_text(errors='replace')[-3000:]}\n{logs}"
        )

    def adopted(self, r: int, g: int, epoch: int) -> dict[str, Any]:
        return self.wait_for(
            lambda: [e for e in self.events(r, g, "epoch") if e["epoch"] == epoch],
            f"worker {(r, g)} adopting epoch {epoch}",
        )[0]

    def exit_code(self, r: int, g: int) -> int:
        proc = self.workers[(r, g)]
        self.wait_for(lambda: proc.poll() is not None, f"worker {(r, g)} exiting")
        return int(proc.returncode)

    def kill(self, *ranks: tuple[int, int], sig: signal.Signals = signal.SIGKILL) -> float:
        t = time.time()
        for rank in ranks:
            os.kill(self.workers[rank].pid, sig)
        return t

    def store(self) -> dist.Store:
        return dist.TCPStore("127.0.0.1", self.address["port"], is_master=False,
                             wait_for_workers=False, timeout=timedelta(seconds=30))  # fmt: skip

    def record(self, epoch: int) -> EpochRecord:
        key = Keys(_RUN).epoch_record(epoch)
        return decode(EpochRecord, self.store().get(key), key=key)

    def close(self) -> None:
        procs = [self.coordinator, *self.workers.values()]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in procs:  # nothing is left behind
            assert p.poll() is not None


@pytest.fixture
def live_job(tmp_path: Path) -> Iterator[Callable[..., LiveJob]]:
    jobs: list[LiveJob] = []

    def start(replicas: int, nproc: int = 1, config: dict[str, float] | None = None,
              *coord_args: str, ack_delay: dict[int, float] | None = None) -> LiveJob:  # fmt: skip
        job = LiveJob(tmp_path, replicas, nproc, config or _CALM, *coord_args, ack_delay=ack_delay)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


@pytest.mark.timeout(240)
def test_sigkill_makes_a_new_epoch_without_the_replica_detected_by_eof(live_job) -> None:
    job = live_job(3)
    assert job.record(0).members == (0, 1, 2)
    t_kill = job.kill((2, 0))
    changes = [job.adopted(r, 0, 1)["change"] for r in (0, 1)]
    record = job.record(1)
    assert record.members == (0, 1)
    assert record.reason == "lost"
    assert "r2g0 liveness EOF" in record.cause  # the lease (20 s) was not what saw it
    # resume_step is the max committed over the survivors' acks, not over everyone.
    keys = Keys(_RUN)
    acks = [decode(Ack, job.store().get(keys.ack(0, r, 0)), key="ack") for r in (0, 1)]
    assert [a.committed for a in acks] == [_committed(0), _committed(1)]
    assert record.resume_step == max(a.committed for a in acks) == _committed(1)
    assert all(c["effective_step"] == _committed(1) + 1 for c in changes)
    print(f"\nEOF detection {1e3 * (record.t_detect - t_kill):.1f} ms after the kill, "
          f"published {1e3 * (record.t_publish - t_kill):.1f} ms")  # fmt: skip


@pytest.mark.timeout(240)
def test_a_survivor_busy_in_its_step_longer_than_the_lease_is_waited_for(live_job) -> None:
    # A survivor acks when its training thread reaches its next collective, which can be a
    # whole forward pass after the death. Its heartbeat stays fresh: it is alive, and the
    # change must wait for it. Before ack_timeout_s the wait was capped at lease_s, so every
    # survivor with a step longer than the lease was evicted with the dead replica (the demo
    # evicted a healthy replica that way under load).
    timing = {**_CALM, "lease_s": 1.0, "stale_s": 0.5}
    job = live_job(3, 1, timing, ack_delay={1: 4.0})  # 4 s: four leases
    job.kill((2, 0))
    record = job.record(1) if job.adopted(0, 0, 1) else None
    assert record is not None and record.members == (0, 1), record
    assert job.adopted(1, 0, 1)["members"] == [0, 1]
    assert record.resume_step == _committed(1)


@pytest.mark.timeout(240)
def test_sigstop_is_evicted_by_the_lease_and_fenced_when_it_wakes(live_job) -> None:
    lease = {**_CALM, "lease_s": 2.0, "stale_s": 1.0}
    job = live_job(3, 1, lease)
    t_stop = job.kill((1, 0), sig=signal.SIGSTOP)
    for r in (0, 2):
        job.adopted(r, 0, 1)
    record = job.record(1)
    assert record.members == (0, 2)
    assert "r1g0 lease expired" in record.cause
    print(f"\nlease detection {1e3 * (record.t_detect - t_stop):.1f} ms after SIGSTOP "
          f"(lease_s={lease['lease_s']})")  # fmt: skip
    os.kill(job.workers[(1, 0)].pid, signal.SIGCONT)
    # Its next call sees that epoch 1 does not admit it.
    assert job.exit_code(1, 0) == 76
    (evicted,) = job.events(1, 0, "evicted")
    assert evicted["epoch"] == 1
    assert not job.events(1, 0, "epoch")
    # Fenced: what it wrote on waking (heartbeat, ack of epoch 0) changed nothing.
    keys = Keys(_RUN)
    assert int(job.store().get(keys.epoch)) == 1
    assert job.record(1).members == (0, 2)
    for r in (0, 2):
        assert [e["epoch"] for e in job.events(r, 0, "epoch")] == [1]


@pytest.mark.timeout(240)
def test_two_replicas_killed_at_once_make_one_change(live_job) -> None:
    job = live_job(4)
    job.kill((1, 0), (3, 0))
    for r in (0, 2):
        job.adopted(r, 0, 1)
    record = job.record(1)
    assert record.members == (0, 2)
    assert "r1g0" in record.cause and "r3g0" in record.cause
    assert record.resume_step == _committed(2)
    assert not job.store().check([Keys(_RUN).epoch_record(2)])


@pytest.mark.timeout(240)
def test_below_min_replicas_the_epoch_is_empty_and_survivors_fall_back(live_job) -> None:
    job = live_job(3, 1, None, "--min-replicas", "2")
    job.kill((1, 0), (2, 0))
    assert job.exit_code(0, 0) == 75
    (lost,) = job.events(0, 0, "lost")
    assert lost["kind"] == "BelowMinReplicas"
    record = job.record(1)
    assert record.members == ()
    assert record.reason == "below min_replicas"
    assert "min_replicas=2" in record.cause


@pytest.mark.timeout(300)
def test_a_replica_with_one_dead_rank_leaves_as_a_whole(live_job) -> None:
    job = live_job(3, 2)
    job.kill((1, 1))
    for rank in ((0, 0), (0, 1), (2, 0), (2, 1)):
        job.adopted(*rank, 1)
    assert job.record(1).members == (0, 2)
    # Its live rank acked, but its replica left whole: it is evicted.
    assert job.exit_code(1, 0) == 76
    assert job.record(1).incarnations.keys() == {"0/0", "0/1", "2/0", "2/1"}


@pytest.mark.timeout(240)
def test_a_killed_coordinator_makes_every_worker_fall_back(live_job) -> None:
    job = live_job(2, 1, {**_CALM, "coordinator_timeout_s": 3.0})
    t_kill = time.time()
    os.kill(job.coordinator.pid, signal.SIGKILL)
    for r in (0, 1):
        assert job.exit_code(r, 0) == 75
        (lost,) = job.events(r, 0, "lost")
        assert lost["kind"] == "CoordinatorLost"
        assert "falling back to whole-job restart" in lost["message"]
        print(f"\nworker {r} raised CoordinatorLost {lost['t'] - t_kill:.2f} s after the kill")


@pytest.mark.timeout(240)
def test_a_silent_coordinator_makes_every_worker_fall_back(live_job) -> None:
    # SIGSTOP: its sockets stay open, so only the silence of coord/beat can tell.
    job = live_job(2, 1, {**_CALM, "coordinator_timeout_s": 3.0})
    os.kill(job.coordinator.pid, signal.SIGSTOP)
    for r in (0, 1):
        assert job.exit_code(r, 0) == 75
        (lost,) = job.events(r, 0, "lost")
        assert lost["kind"] == "CoordinatorLost"
        assert "silent" in lost["message"]


def _restart(job: LiveJob, *ranks: tuple[int, int]) -> list[dict[str, Any]]:
    """Start each (dead) rank again, as its torchrun would; its first event ("ready")."""
    for rank in ranks:
        job.workers[rank].wait(timeout=_WAIT_S)
        job._start_worker(*rank)
    return [job.wait_for(lambda r=r: job.events(*r, "ready"), f"{r} ready")[0] for r in ranks]


@pytest.mark.timeout(240)
def test_when_every_member_is_gone_their_restarts_start_a_fresh_membership(live_job) -> None:
    # docs/live-membership.md §2.5: after a fallback restart every worker may fail again (they
    # did, at the redo of a step). Their restarts must not find an epoch naming the dead
    # incarnations and wait as joiners with nobody to heal them until join_timeout_s.
    job = live_job(2)
    old = {job.events(r, 0, "ready")[0]["inc"] for r in (0, 1)}
    job.kill((0, 0), (1, 0))
    job.wait_for(lambda: job.store().check([Keys(_RUN).epoch_record(1)]), "epoch 1")
    assert job.record(1).members == ()
    ready = _restart(job, (0, 0), (1, 0))
    record = job.record(2)
    assert (record.reason, record.members) == ("start", (0, 1)), record
    assert record.incarnations == {f"{r}/0": ready[r]["inc"] for r in (0, 1)}
    assert not old & set(record.incarnations.values())  # fenced: no dead incarnation
    assert [(e["epoch"], e["members"]) for e in ready] == [(2, [0, 1])] * 2
    # The fresh membership detects and decides like the first one.
    job.kill((1, 0))
    job.adopted(0, 0, 3)
    assert job.record(3).members == (0,)


@pytest.mark.timeout(240)
def test_below_min_replicas_the_restarted_job_starts_afresh_without_the_old_ranks(
    live_job,
) -> None:
    job = live_job(2, 1, None, "--min-replicas", "2")
    job.kill((1, 0))
    assert job.exit_code(0, 0) == 75  # the survivor left (BelowMinReplicas)
    assert job.record(1).members == ()
    ready = _restart(job, (0, 0), (1, 0))
    record = job.record(2)
    assert (record.reason, record.members) == ("start", (0, 1)), record
    assert [e["epoch"] for e in ready] == [2, 2]
    assert record.incarnations == {f"{r}/0": ready[r]["inc"] for r in (0, 1)}


@pytest.mark.timeout(240)
def test_members_that_finish_end_the_run_and_a_late_restart_exits_at_once(live_job) -> None:
    # Members closing at the end of training were taken for lost replicas: the run ended with
    # an empty "below min_replicas" epoch and a replica restarted after that waited out
    # join_timeout_s as a joiner nobody could heal.
    job = live_job(2)
    job.kill((0, 0), (1, 0), sig=signal.SIGUSR1)  # both reach the end of training
    assert [job.exit_code(r, 0) for r in (0, 1)] == [0, 0]
    assert [job.events(r, 0, "finished")[0]["all_done"] for r in (0, 1)] == [True, True]
    job.wait_for(lambda: job.store().check([Keys(_RUN).epoch_record(1)]), "epoch 1")
    record = job.record(1)
    assert (record.reason, record.members, record.resume_step) == ("finished", (), 107), record
    assert not job.store().check([Keys(_RUN).epoch_record(2)])
    t0 = time.monotonic()
    job._start_worker(0, 0)  # a restart after the end: told so, not left waiting to join
    assert job.exit_code(0, 0) == 0
    (told,) = job.events(0, 0, "run_finished")
    assert (told["epoch"], told["step"]) == (1, 107)
    assert "the run finished at step 107" in told["message"]
    print(f"late restart exited after {time.monotonic() - t0:.2f} s")


@pytest.mark.timeout(240)
def test_a_survivor_that_finishes_after_a_loss_ends_the_run(live_job) -> None:
    job = live_job(2)
    job.kill((1, 0))
    assert job.adopted(0, 0, 1)["members"] == [0]
    job.kill((0, 0), sig=signal.SIGUSR1)
    assert job.exit_code(0, 0) == 0
    job.wait_for(lambda: job.store().check([Keys(_RUN).epoch_record(2)]), "epoch 2")
    record = job.record(2)
    assert (record.reason, record.members, record.resume_step) == ("finished", (), 100), record
    job._start_worker(1, 0)  # replica 1's torchrun restarts it after the end
    assert job.exit_code(1, 0) == 0
    assert job.events(1, 0, "run_finished")[0]["step"] == 100


@pytest.mark.timeout(180)
def test_the_store_handed_out_is_bounded_against_a_stopped_coordinator(tmp_path: Path) -> None:
    # Membership.store() is what the heal's transfers and the cross-replica group's Gloo
    # rendezvous use. A c10d request to a SIGSTOPped coordinator never returns: before, those
    # callers hung; now each request raises CoordinatorLost naming the address.
    config = {**_CALM, "coordinator_timeout_s": 2.0}
    ready = tmp_path / "coord.ready"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in config.items() if k != "poll_slice_s"]
    with open(tmp_path / "coord.log", "wb") as log:
        coord = subprocess.Popen(
            [sys.executable, "-m", "lm_resiliency.cli", "coordinator", "--port", "0",
             "--run-id", _RUN, "--replica-groups", "1", "--nproc-per-group", "1",
             "--ready-file", str(ready), *flags],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    m: Membership | None = None
    try:
        deadline = time.monotonic() + _WAIT_S
        while not ready.exists():
            assert time.monotonic() < deadline and coord.poll() is None, "no coordinator"
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        env = {"LMR_LIVE_COORDINATOR": address, "LMR_LIVE_RUN": _RUN, "LMR_REPLICA_GROUP": "0",
               "LMR_REPLICA_GROUPS": "1", "RANK": "0"}  # fmt: skip
        m = Membership.from_env(LiveConfig(**config), env)
        store = m.store()
        prefixed = dist.PrefixStore("test", store.clone())  # as the group's rendezvous wraps it
        prefixed.set("k", "v")
        assert (store.get("test/k"), prefixed.get("k")) == (b"v", b"v")
        os.kill(coord.pid, signal.SIGSTOP)
        errors: dict[str, str] = {}

        def requests() -> None:
            for name, call in (("get", lambda: store.get("test/k")),
                               ("check", lambda: store.check(["test/k"])),
                               ("prefixed get", lambda: prefixed.get("k"))):  # fmt: skip
                try:
                    call()
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"

        caller = threading.Thread(target=requests, daemon=True)
        caller.start()
        caller.join(_WAIT_S)  # each request is bounded by 2 x coordinator_timeout_s
        assert not caller.is_alive(), "a store request to the stopped coordinator hung"
        assert set(errors) == {"get", "check", "prefixed get"}, errors
        for name in ("get", "check"):
            assert errors[name].startswith("CoordinatorLost"), errors
        assert all(address in e and "silent" in e for e in errors.values()), errors
        with pytest.raises(CoordinatorLost, match="silent"):  # the membership knows it too
            m.check()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(coord.pid, signal.SIGCONT)
        coord.terminate()
        coord.wait(timeout=30)
        if m is not None:
            m.close()

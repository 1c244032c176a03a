"""``lm-resiliency launch``: one real torchrun per replica group, real signals, real teardown.

Most tests pass ``--coordinator`` pointing at a ``TCPStore`` the test hosts. It stands in for an
external coordinator (the multi-node path): the launcher's own mechanics (the torchruns, the
environment, signals, exit statuses, the teardown) do not depend on the coordinator's logic, and
the workers prove the address works by writing to that store. The tests that let the launcher
start the coordinator itself run against ``lm-resiliency coordinator`` (interface 1 of
docs/live-membership.md) and check the clear failure when it is missing or exits early.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from lm_resiliency import _proctree
from lm_resiliency.cli import launch
from lm_resiliency.testing.torchrun import free_port

WORKER = str(Path(__file__).with_name("live_launch_worker.py"))
HAS_COORDINATOR = importlib.util.find_spec("lm_resiliency.cli.coordinator") is not None
pytestmark = pytest.mark.timeout(300)


class Launch:
    """One launcher process, its output, and every process it started (for the teardown check)."""

    def __init__(self, args: list[str], outdir: Path) -> None:
        self.outdir = outdir
        self.err = outdir / "launcher.stderr"
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lm_resiliency.cli", "launch", *args],
                stdout=err,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # As a user runs it: OMP_NUM_THREADS is the launcher's to set.
                env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                | {"PYTHONUNBUFFERED": "1"},
            )
        self.seen: set[int] = set()

    def records(self) -> dict[str, dict[str, object]]:
        return {p.stem: json.loads(p.read_text()) for p in self.outdir.glob("g*-r*-a*.json")}

    def wait_for(self, names: set[str], timeout_s: float = 240) -> dict[str, dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.seen.update(_proctree.descendants(self.proc.pid))
            got = self.records()
            if names <= set(got):
                return got
            assert self.proc.poll() is None, f"launcher exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"waited for {names - set(got)}:\n{self.output()}"
            time.sleep(0.2)

    def wait(self, timeout_s: float = 240) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            self.seen.update(_proctree.descendants(self.proc.pid))
            assert time.monotonic() < deadline, f"launcher did not exit:\n{self.output()}"
            time.sleep(0.2)
        return self.proc.returncode

    def output(self) -> str:
        return self.err.read_text(errors="replace")

    def kill(self) -> None:
        tree = [self.proc.pid, *_proctree.descendants(self.proc.pid), *self.seen]
        _proctree.signal_all(tree, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))  # fmt: skip
    yield server


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for job in started:  # no test leaves a process behind, even when it fails
        job.kill()


def _start(launched: list[Launch], tmp_path: Path, args: list[str]) -> Launch:
    job = Launch(args, tmp_path)
    launched.append(job)
    return job


def _external(store: TCPStore, run: str = "run-t") -> list[str]:
    return ["--coordinator", f"127.0.0.1:{store.port}", "--run-id", run]


def _names(groups: int, nproc: int, attempt: int = 0) -> set[str]:
    return {f"g{g}-r{r}-a{attempt}" for g in range(groups) for r in range(nproc)}


def _assert_all_gone(job: Launch, pids: set[int]) -> None:
    left = [pid for pid in pids | job.seen if _proctree.alive(pid)]
    assert not left, f"processes left running: {left}\n{job.output()}"


@pytest.mark.slow
@pytest.mark.parametrize(("groups", "nproc"), [(3, 1), (2, 2)])
def test_each_group_is_its_own_torchrun_with_the_live_environment(
    store: TCPStore, launched: list[Launch], tmp_path: Path, groups: int, nproc: int
) -> None:
    job = _start(launched, tmp_path, [
        "--replica-groups", str(groups), "--nproc-per-group", str(nproc), *_external(store),
        "--", WORKER, str(tmp_path), "--touch-store",
    ])  # fmt: skip
    assert job.wait() == 0, job.output()
    records = job.records()
    assert set(records) == _names(groups, nproc)
    agents: dict[int, set[int]] = {}
    for name, rec in records.items():
        g, r = int(name[1 : name.index("-")]), int(name.split("-")[1][1:])
        env = rec["env"]
        assert isinstance(env, dict)
        assert env == {
            "LMR_LIVE_COORDINATOR": f"127.0.0.1:{store.port}",
            "LMR_LIVE_RUN": "run-t",
            "LMR_REPLICA_GROUP": str(g),
            "LMR_REPLICA_GROUPS": str(groups),
            "LMR_LIVE_SPARE": None,
            "RANK": str(r),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(r),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "OMP_NUM_THREADS": "1",  # set by the launcher: R * N workers share the host
        }, name
        agents.setdefault(g, set()).add(int(rec["ppid"]))  # type: ignore[call-overload]
        assert store.add(f"lmr/live/run-t/seen/{g}/{r}", 0) == 1  # the address works
    # One torchrun agent per group, none shared.
    assert all(len(a) == 1 for a in agents.values())
    assert len(set().union(*agents.values())) == groups
    _assert_all_gone(job, set())


@pytest.mark.slow
def test_a_killed_worker_is_restarted_by_its_own_torchrun_only(
    store: TCPStore, launched: list[Launch], tmp_path: Path
) -> None:
    job = _start(launched, tmp_path, [
        "--replica-groups", "3", "--nproc-per-group", "1", "--max-restarts", "1",
        *_external(store), "--", WORKER, str(tmp_path), "--wait",
    ])  # fmt: skip
    before = job.wait_for(_names(3, 1))
    os.kill(int(before["g1-r0-a0"]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    after = job.wait_for(_names(3, 1) | {"g1-r0-a1"})
    assert after["g1-r0-a1"]["ppid"] == before["g1-r0-a0"]["ppid"]  # the same torchrun
    assert after["g1-r0-a1"]["pid"] != before["g1-r0-a0"]["pid"]
    for g in (0, 2):  # the other groups: same processes, never restarted
        assert _proctree.alive(int(before[f"g{g}-r0-a0"]["pid"]))  # type: ignore[call-overload]
    (tmp_path / "stop").touch()
    assert job.wait() == 0, job.output()
    assert set(job.records()) == _names(3, 1) | {"g1-r0-a1"}


@pytest.mark.slow
def test_sigterm_stops_every_group_and_leaves_no_process(
    store: TCPStore, launched: list[Launch], tmp_path: Path
) -> None:
    job = _start(launched, tmp_path, [
        "--replica-groups", "2", "--nproc-per-group", "2", "--term-grace-s", "20",
        *_external(store), "--", WORKER, str(tmp_path), "--wait",
    ])  # fmt: skip
    records = job.wait_for(_names(2, 2))
    pids = {int(r[k]) for r in records.values() for k in ("pid", "ppid")}  # type: ignore[call-overload]
    assert len(pids) == 6  # 4 workers, 2 agents
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.output()
    assert "got signal 15; stopping every replica group" in job.output()
    _assert_all_gone(job, pids)


@pytest.mark.slow
def test_the_worst_exit_status_is_returned(
    store: TCPStore, launched: list[Launch], tmp_path: Path
) -> None:
    job = _start(launched, tmp_path, [
        "--replica-groups", "2", "--nproc-per-group", "1", "--max-restarts", "0",
        *_external(store), "--", WORKER, str(tmp_path), "--exit", "1:3",
    ])  # fmt: skip
    # Group 1's worker exits 3, torchrun gives up (exit 1); group 0 succeeds.
    assert job.wait() == 1, job.output()
    assert "replica groups exited with [0, 1]" in job.output()


def _launch_main(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    return launch.main(args, stderr=err), err.getvalue()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--replica-groups", "1", "--nproc-per-group", "2", "--", "t.py"],
         "--replica-groups 1 has no replica dimension"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "t.py"],
         "no training command: put it after '--'"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--"],
         "no training command after '--'"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--", "-m"],
         "no training command after '--'"),
        (["--replica-groups", "2", "--nproc-per-group", "0", "--", "t.py"],
         "--nproc-per-group 0 must be >= 1"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--nproc-per-node=4", "--", "t.py"],
         "torchrun argument '--nproc-per-node=4' is set by the launcher"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--rdzv_endpoint", "h:1", "--",
          "t.py"], "torchrun argument '--rdzv_endpoint' is set by the launcher"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "t.py", "--", "x"],
         "unexpected argument 't.py' before '--'"),
        (["--replica-groups", "2", "--nproc-per-group", "2", "--warm-spares", "1", "--", "t.py"],
         "--warm-spares 1 needs --nproc-per-group 1"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--coordinator", "nohost", "--",
          "t.py"], "--coordinator 'nohost' is not HOST:PORT"),
        (["--replica-groups", "2", "--nproc-per-group", "1", "--coordinator", "h:29600", "--",
          "t.py"], "--coordinator h:29600 needs --run-id"),
    ],
)  # fmt: skip
def test_bad_command_lines_exit_2_with_the_fix(args: list[str], fragment: str) -> None:
    code, err = _launch_main(args)
    assert code == 2
    assert fragment in err


def test_an_unreachable_coordinator_is_named() -> None:
    port = free_port()
    code, err = _launch_main([
        "--replica-groups", "2", "--nproc-per-group", "1", "--coordinator", f"127.0.0.1:{port}",
        "--run-id", "r", "--coordinator-timeout-s", "0.5", "--", "t.py",
    ])  # fmt: skip
    assert code == 2
    assert f"no coordinator listening at --coordinator 127.0.0.1:{port}" in err


def test_the_launcher_fails_clearly_when_its_coordinator_is_missing_or_exits_early(
    tmp_path: Path,
) -> None:
    args = ["--replica-groups", "2", "--nproc-per-group", "1"]
    if HAS_COORDINATOR:  # a coordinator that exits at once: a bad option of its own
        args += ["--coordinator-arg=--no-such-option"]
    # A process the caller already had (in a test run: multiprocessing's forkserver) is not
    # the launcher's to kill: an in-process run once SIGKILLed the suite's forkserver, and
    # every later multi-process test failed.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code, err = _launch_main([*args, "--", WORKER, str(tmp_path)])
        assert bystander.poll() is None, "the launcher's teardown killed a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
    assert code == 2
    if HAS_COORDINATOR:
        assert "the coordinator (" in err and "exited with status 2 before it was listening" in err
        assert "--no-such-option" in err  # its own message, from its output
    else:
        assert "no coordinator subcommand (module lm_resiliency.cli.coordinator is missing)" in err
        assert "--coordinator HOST:PORT --run-id RUN" in err
    assert not list(tmp_path.glob("g*.json"))  # no group was started


@pytest.mark.slow
@pytest.mark.skipif(not HAS_COORDINATOR, reason="needs lm-resiliency coordinator (live-coord)")
def test_the_started_coordinator_serves_the_workers_and_is_restarted_when_it_dies(
    launched: list[Launch], tmp_path: Path
) -> None:
    job = _start(launched, tmp_path, [
        "--replica-groups", "2", "--nproc-per-group", "1", "--run-id", "run-c",
        "--coordinator-arg=--lease-s=30", "--coordinator-arg=--heartbeat-s=1",
        "--coordinator-arg=--stale-s=15",
        "--", WORKER, str(tmp_path), "--touch-store", "--wait",
    ])  # fmt: skip
    records = job.wait_for(_names(2, 1))
    coords = {json.dumps(r["coord"], sort_keys=True) for r in records.values()}
    assert len(coords) == 1
    coord = json.loads(coords.pop())
    assert coord["generation"] == 0
    assert coord["pid"] in _proctree.descendants(job.proc.pid)
    address = {r["env"]["LMR_LIVE_COORDINATOR"] for r in records.values()}  # type: ignore[index]
    os.kill(coord["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while "(generation 1, pid" not in job.output():
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.2)
    host, port = address.pop().rsplit(":", 1)  # the same address: the workers' env names it
    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    assert json.loads(client.get("lmr/live/run-c/coord"))["generation"] == 1
    (tmp_path / "stop").touch()
    assert job.wait() == 0, job.output()
    _assert_all_gone(job, {coord["pid"]})


def test_the_launcher_sets_one_omp_thread_per_worker_unless_the_caller_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = launch.parse([
        "--replica-groups", "4", "--nproc-per-group", "1", "--", "train.py",
    ])  # fmt: skip
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch._worker_env(plan, "h:1", group=0, spare=None)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch._worker_env(plan, "h:1", group=0, spare=None)["OMP_NUM_THREADS"] == "3"

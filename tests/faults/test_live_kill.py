"""A replica SIGKILLed at each point of a step, through the real launcher and coordinator.

4 replica groups of one process each (``lm-resiliency launch --replica-groups 4
--nproc-per-group 1``) train the demo model in the plain MTGS loop
(``lm_resiliency.demo.live_worker``: a ``DataLoader`` with ``batch_sampler=handle.sampler``,
no exception handling). The chosen replicas die at a ``live.*`` kill point of step 4; their
torchrun restarts them and they register as joiners; the run ends (7 steps) before their
admission, and the launcher is torn down (healing and rejoining: test_live_rejoin.py). The
survivors must go on without restarting: ``check_run`` checks
the invariants of docs/live-membership.md §9 from the event logs (PIDs unchanged, no step
skipped or repeated, every sample of every committed step consumed once, equal digests after
every commit), and the kill in the forward must end bit-identical to a run where the replica
leaves cleanly before the same step (``leave@1:4``). Each kill point is covered once (the
bucket all-reduce by the replica holding global rank 0): every case is a whole launch of
9 processes, and the suite's time on 2 cores is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm_resiliency._proctree import alive as _alive
from lm_resiliency.live.runcheck import LiveRun, check_run

pytestmark = pytest.mark.slow

_STEPS = 7
_KILL_STEP = 4
_B, _SAMPLES, _SEED = 16, 512, 0
_TIMING = ["--heartbeat-s", "0.2", "--lease-s", "6", "--stale-s", "3", "--reform-timeout-s", "60",
           "--coordinator-timeout-s", "30"]  # fmt: skip
_COORD = ["--coordinator-arg=--heartbeat-s=0.2", "--coordinator-arg=--lease-s=6",
          "--coordinator-arg=--stale-s=3"]  # fmt: skip
_WORKER = str(Path(__file__).with_name("live_kill_worker.py"))


def _launch(run_dir: Path, *, kill: str = "", replicas: str = "", faults: str = "") -> LiveRun:
    env = dict(os.environ, LMR_LIVE_EVENTS=str(run_dir), LIVE_KILL_REPLICAS=replicas)
    if kill:
        env["LM_RESILIENCY_TEST_KILL"] = f"{kill}@{_KILL_STEP}"
    if faults:
        env["LM_RESILIENCY_FAULTS"] = "1"
    cmd = [sys.executable, "-m", "lm_resiliency.cli", "launch", "--replica-groups", "4",
           "--nproc-per-group", "1", "--term-grace-s", "10", *_COORD, "--", _WORKER,
           "--steps", str(_STEPS), "--global-batch", str(_B), *_TIMING]  # fmt: skip
    if faults:
        cmd += ["--faults", faults]
    out = (run_dir / "launcher.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    gone = {int(r) for r in replicas.split(",") if r}
    if faults.startswith("leave@"):
        gone.add(int(faults.split("@")[1].split(":", maxsplit=1)[0]))
    survivors = [r for r in range(4) if r not in gone]
    deadline = time.monotonic() + 600
    try:
        while not all(_committed(run_dir, r, _STEPS) for r in survivors) or not all(
            _joining(run_dir, r) for r in gone if replicas
        ):
            assert proc.poll() is None or gone == set(), (
                f"launcher exited {proc.returncode} before the survivors finished: "
                + (run_dir / "launcher.log").read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "survivors did not finish within 600 s"
            time.sleep(0.5)
        # Every group ends by itself: a restarted replica the end came before is told the
        # run finished and exits 0 (it used to wait as a joiner until stopped).
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    text = (run_dir / "launcher.log").read_text()
    assert rc == 0, text[-3000:]
    for r in gone if replicas else ():
        assert _ended(run_dir, r), f"replica {r}'s restart was neither healed nor told the end"
    run = check_run(run_dir, stream=(_SEED, _SAMPLES, _B))
    pids = [p for ps in run.pids.values() for p in ps]
    assert not [p for p in pids if _alive(p)], "a worker outlived the launcher"
    return run


def _committed(run_dir: Path, replica: int, step: int) -> bool:
    path = run_dir / f"events-replica-{replica}-rank-0.jsonl"
    if not path.exists():
        return False
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return any(r["event"] == "mtgs.commit" and r["step"] == step for r in records)


def _joining(run_dir: Path, replica: int) -> bool:
    """Whether the replica's torchrun restarted it and it registered as a joiner."""
    path = run_dir / f"events-replica-{replica}-rank-0.jsonl"
    return path.exists() and '"event": "live.joining"' in path.read_text()


def _ended(run_dir: Path, replica: int) -> bool:
    """Whether the replica's restart was healed, or told that every member had finished."""
    text = (run_dir / f"events-replica-{replica}-rank-0.jsonl").read_text()
    return '"event": "live.healed"' in text or '"event": "live.run_finished"' in text


def _check_kill(run: LiveRun, run_dir: Path, killed: set[int]) -> None:
    assert set(run.survivors) == set(range(4)) - killed
    assert set(run.lost) == killed
    for step in range(1, _STEPS + 1):
        want = set(range(4)) if step < _KILL_STEP else set(range(4)) - killed
        assert set(run.members_at(step)) == want, (step, run.members_at(step))
    for r in killed:
        assert len(run.pids[r]) == 2, f"replica {r}: its torchrun did not restart it ({run.pids})"
    # The commit log says what a redone step went through: the commit that adopted a change
    # carries its attempts (the change's redo among them) and its aborts.
    redone = [c for s in run.commits.values() for c in s if "change" in c]
    assert any(c["step"] == _KILL_STEP for c in redone), run.commits[_KILL_STEP]
    for c in redone:
        assert c.get("attempts", 1) >= 2 and isinstance(c.get("aborts"), list), c
    t_kill = min(float((run_dir / f"kill-{r}").read_text()) for r in killed)
    first = run.first_commit_time(_KILL_STEP) - t_kill
    print(f"\nfirst committed step of the survivors {first:.2f} s after the kill")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("point", "replicas"),
    [
        # live.forward with replica 1 is the kill of test_kill_in_forward_equals_scripted_leave.
        ("live.bucket_allreduce", "0"),  # the replica holding global rank 0
        ("live.before_step", "3"),
        ("live.vote", "1"),
        ("live.forward", "1,2"),  # two at once
    ],
    ids=["allreduce-replica-0", "before-step", "vote", "two-at-once"],
)
def test_survivors_keep_training(tmp_path: Path, point: str, replicas: str) -> None:
    run = _launch(tmp_path, kill=point, replicas=replicas)
    _check_kill(run, tmp_path, {int(r) for r in replicas.split(",")})


@pytest.mark.timeout(1200)
def test_kill_in_forward_equals_scripted_leave(tmp_path: Path) -> None:
    (tmp_path / "leave").mkdir()
    (tmp_path / "kill").mkdir()
    leave = _launch(tmp_path / "leave", faults=f"leave@1:{_KILL_STEP}")
    assert set(leave.survivors) == {0, 2, 3}
    kill = _launch(tmp_path / "kill", kill="live.forward", replicas="1")
    _check_kill(kill, tmp_path / "kill", {1})
    check_run(tmp_path / "kill", reference=leave)
    assert kill.final_digest == leave.final_digest

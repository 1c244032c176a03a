"""A warm spare takes a SIGKILLed replica's place: healed from a member, no process start.

``lm-resiliency launch --replica-groups 4 --nproc-per-group 1 --warm-spares 1`` trains the demo
model in the plain MTGS loop (``lm_resiliency.demo.live_worker`` through
``live_kill_worker.py``). The spare runs the same script up to ``enable_resiliency`` and waits
there. Replica 1 dies in the forward of step 4; the coordinator hands its vacancy to the spare,
which registers as replica 1's joiner and is healed from a member at a step boundary h. The
killed process's torchrun starts replica 1 again; it finds the replica taken and waits as a
spare until the run finishes (exit 0).

Checked: ``check_run``'s invariants (no step skipped or repeated per process, every sample
once, equal digests after every commit, the survivors' PIDs unchanged); replica 1's second
process is the spare (a ``live.takeover`` record) and it was started with the run, before the
kill; the restarted worker became a spare and never registered as replica 1; the run ends
bit-identical to the scripted ``leave@1:4,join@1:h+1`` with the h the spare was healed at.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lm_resiliency.live.runcheck import LiveRun, check_run, read_events

pytestmark = pytest.mark.slow

_STEPS = 30
_KILL_STEP = 4
_B, _SAMPLES, _SEED = 16, 512, 0
_TIMING = ["--heartbeat-s", "0.2", "--lease-s", "6", "--stale-s", "3", "--reform-timeout-s", "60",
           "--coordinator-timeout-s", "30", "--step-sleep-s", "0.4"]  # fmt: skip
_COORD = ["--coordinator-arg=--heartbeat-s=0.2", "--coordinator-arg=--lease-s=6",
          "--coordinator-arg=--stale-s=3"]  # fmt: skip
_WORKER = str(Path(__file__).with_name("live_kill_worker.py"))


def _launch(run_dir: Path, *, spares: int = 0, kill: str = "", faults: str = "") -> LiveRun:
    env = dict(os.environ, LMR_LIVE_EVENTS=str(run_dir), LIVE_KILL_REPLICAS="1" if kill else "")
    env.pop("OMP_NUM_THREADS", None)
    if kill:
        env["LM_RESILIENCY_TEST_KILL"] = f"{kill}@{_KILL_STEP}"
    if faults:
        env["LM_RESILIENCY_FAULTS"] = "1"
    cmd = [sys.executable, "-m", "lm_resiliency.cli", "launch", "--replica-groups", "4",
           "--nproc-per-group", "1", "--warm-spares", str(spares), "--term-grace-s", "10",
           *_COORD, "--", _WORKER, "--steps", str(_STEPS), "--global-batch", str(_B),
           *_TIMING]  # fmt: skip
    if faults:
        cmd += ["--faults", faults]
    with (run_dir / "launcher.log").open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (run_dir / "launcher.log").read_text()
    assert rc == 0, f"launcher exited {rc}: {log[-4000:]}"
    run = check_run(run_dir, stream=(_SEED, _SAMPLES, _B))
    assert set(run.survivors) == {0, 1, 2, 3}, (run.survivors, log[-4000:])
    assert run.rejoined == (1,), (run.rejoined, run.pids)
    assert len(run.pids[1]) == 2, run.pids
    (healed_at,) = set(run.healed.values())
    for step in range(1, _STEPS + 1):
        want = {0, 1, 2, 3} if step < _KILL_STEP or step > healed_at else {0, 2, 3}
        assert set(run.members_at(step)) == want, (step, run.members_at(step))
    return run


@pytest.mark.timeout(900)
def test_a_warm_spare_takes_over_a_killed_replica(tmp_path: Path) -> None:
    (tmp_path / "kill").mkdir()
    (tmp_path / "script").mkdir()
    kill = _launch(tmp_path / "kill", spares=1, kill="live.forward")
    log = (tmp_path / "kill" / "launcher.log").read_text()
    records = read_events(tmp_path / "kill")
    takeovers = [r for r in records if r["event"] == "live.takeover"]
    assert len(takeovers) == 1, (takeovers, log[-4000:])
    (takeover,) = takeovers
    spare_pid = kill.pids[1][1]
    assert takeover["pid"] == spare_pid and takeover["replica"] == 1, takeover
    t_kill = float((tmp_path / "kill" / "kill-1").read_text())
    # The spare was started with the run, long before the kill (it waited, it did not start).
    assert takeover["waited_s"] > 0 and takeover["assigned_t"] > t_kill, takeover
    spare_lines = re.findall(r"warm spare (\d+) \(pid (\d+)\) waiting", log)
    assert [int(p) for _, p in spare_lines][:1] == [spare_pid], (spare_lines, log[-4000:])
    # The killed worker's restart found replica 1 taken and waited as a spare (second line).
    assert "replica 1 rank 0 was taken over by another process" in log, log[-4000:]
    assert len(spare_lines) == 2, (spare_lines, log[-4000:])
    assert int(spare_lines[1][1]) not in kill.pids[1], (spare_lines, kill.pids)
    (h,) = set(kill.healed.values())
    # A healthy step makes no store request on the training and watcher threads: the watcher
    # reads the failure flag only when the coordinator pokes (liveness.py). Between the
    # heal and the end every replica's count stands still.
    for r in (0, 2, 3):
        counts = {c["step"]: c["requests"] for c in records
                  if c["event"] == "mtgs.commit" and c["replica"] == r}  # fmt: skip
        calm = [counts[s] for s in range(h + 2, _STEPS)]
        assert len(set(calm)) == 1, (r, {s: counts[s] for s in range(h + 2, _STEPS)})
        early = [counts[s] for s in range(2, _KILL_STEP)]
        assert len(set(early)) == 1, (r, early)
    first = kill.first_commit_time(_KILL_STEP) - t_kill
    full = kill.world_full_time() - t_kill
    print(f"\nwarm spare: kill -> first committed step of the survivors {first:.2f} s; "
          f"kill -> full world again {full:.2f} s (healed at step {h})")  # fmt: skip
    script = _launch(tmp_path / "script", faults=f"leave@1:{_KILL_STEP},join@1:{h + 1}")
    assert set(script.healed.values()) == {h}
    check_run(tmp_path / "kill", reference=script)
    assert kill.final_digest == script.final_digest

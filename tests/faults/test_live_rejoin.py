"""A SIGKILLed replica restarted by its torchrun is healed from a member and admitted again.

4 replica groups of one process each (``lm-resiliency launch --replica-groups 4
--nproc-per-group 1``) train the demo model in the plain MTGS loop
(``lm_resiliency.demo.live_worker``, through ``live_kill_worker.py``). Replica 1 dies in the
forward of step 4; the survivors go on with 3 members; its torchrun starts it again, it
registers as a joiner, a member streams it the capture tree at a step boundary h, and from
h+1 the world is full again. ``check_run`` checks the invariants per incarnation (no step
skipped or repeated, every sample once, equal digests after every commit, the survivors'
PIDs unchanged), and the run must end bit-identical to the scripted ``leave@1:4,join@1:j``
with the j the kill run recorded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_resiliency.live.runcheck import LiveRun, check_run

pytestmark = pytest.mark.slow

_STEPS = 40
_KILL_STEP = 4
_B, _SAMPLES, _SEED = 16, 512, 0
_TIMING = ["--heartbeat-s", "0.2", "--lease-s", "6", "--stale-s", "3", "--reform-timeout-s", "60",
           "--coordinator-timeout-s", "30", "--step-sleep-s", "0.4"]  # fmt: skip
_COORD = ["--coordinator-arg=--heartbeat-s=0.2", "--coordinator-arg=--lease-s=6",
          "--coordinator-arg=--stale-s=3"]  # fmt: skip
_WORKER = str(Path(__file__).with_name("live_kill_worker.py"))


def _launch(run_dir: Path, *, kill: str = "", faults: str = "") -> LiveRun:
    env = dict(os.environ, LMR_LIVE_EVENTS=str(run_dir), LIVE_KILL_REPLICAS="1" if kill else "")
    if kill:
        env["LM_RESILIENCY_TEST_KILL"] = f"{kill}@{_KILL_STEP}"
    if faults:
        env["LM_RESILIENCY_FAULTS"] = "1"
    cmd = [sys.executable, "-m", "lm_resiliency.cli", "launch", "--replica-groups", "4",
           "--nproc-per-group", "1", "--term-grace-s", "10", *_COORD, "--", _WORKER,
           "--steps", str(_STEPS), "--global-batch", str(_B), *_TIMING]  # fmt: skip
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
    log = (run_dir / "launcher.log").read_text()[-4000:]
    assert rc == 0, f"launcher exited {rc}: {log}"
    run = check_run(run_dir, stream=(_SEED, _SAMPLES, _B))
    assert [p for ps in run.pids.values() for p in ps if _alive(p)] == [], "a worker outlived it"
    assert set(run.survivors) == {0, 1, 2, 3}, (run.survivors, log)
    assert run.rejoined == (1,), (run.rejoined, run.pids)
    assert len(run.pids[1]) == 2, run.pids
    (healed_at,) = set(run.healed.values())
    for step in range(1, _STEPS + 1):
        want = {0, 1, 2, 3} if step < _KILL_STEP or step > healed_at else {0, 2, 3}
        assert set(run.members_at(step)) == want, (step, run.members_at(step))
    assert run.world_full, "no live.world_full record"
    return run


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(1500)
def test_killed_replica_rejoins_and_equals_scripted_membership(tmp_path: Path) -> None:
    (tmp_path / "kill").mkdir()
    (tmp_path / "script").mkdir()
    kill = _launch(tmp_path / "kill", kill="live.forward")
    (h,) = set(kill.healed.values())
    t_kill = float((tmp_path / "kill" / "kill-1").read_text())
    first = kill.first_commit_time(_KILL_STEP) - t_kill
    full = kill.world_full_time() - t_kill
    print(f"\nkill -> first committed step of the survivors {first:.2f} s; "
          f"kill -> full world again {full:.2f} s (healed at step {h})")  # fmt: skip
    script = _launch(tmp_path / "script", faults=f"leave@1:{_KILL_STEP},join@1:{h + 1}")
    assert set(script.healed.values()) == {h}
    check_run(tmp_path / "kill", reference=script)
    assert kill.final_digest == script.final_digest

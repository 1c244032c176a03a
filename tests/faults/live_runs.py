"""One launch of the live demo worker for the fault tests (``live_kill_worker.py`` under
``lm-resiliency launch``, 4 replica groups of one process), checked by ``check_run``.

The timings are calm (lease 6 s, the coordinator's too) and each forward sleeps 0.4 s, a
stand-in for real compute, so a killed replica's torchrun restart is back before the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lm_resiliency._proctree import alive
from lm_resiliency.live.runcheck import LiveRun, check_run

B, SAMPLES, SEED = 16, 512, 0
TIMING = ["--heartbeat-s", "0.2", "--lease-s", "6", "--stale-s", "3", "--reform-timeout-s", "60",
          "--coordinator-timeout-s", "30", "--step-sleep-s", "0.4"]  # fmt: skip
COORD = ["--coordinator-arg=--heartbeat-s=0.2", "--coordinator-arg=--lease-s=6",
         "--coordinator-arg=--stale-s=3"]  # fmt: skip
WORKER = str(Path(__file__).with_name("live_kill_worker.py"))


def launch(
    run_dir: Path, *, steps: int, kill: str = "", faults: str = "", spares: int = 0
) -> tuple[LiveRun, str]:
    """Run the job to its end; ``kill``: ``<kill point>@<step>`` in replica 1's first
    process. Returns what ``check_run`` found and the launcher's output."""
    env = dict(os.environ, LMR_LIVE_EVENTS=str(run_dir), LIVE_KILL_REPLICAS="1" if kill else "")
    env.pop("OMP_NUM_THREADS", None)  # the launcher's own default, as a user gets it
    if kill:
        env["LM_RESILIENCY_TEST_KILL"] = kill
    if faults:
        env["LM_RESILIENCY_FAULTS"] = "1"
    cmd = [sys.executable, "-m", "lm_resiliency.cli", "launch", "--replica-groups", "4",
           "--nproc-per-group", "1", "--warm-spares", str(spares), "--term-grace-s", "10",
           *COORD, "--", WORKER, "--steps", str(steps), "--global-batch", str(B),
           *TIMING]  # fmt: skip
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
    run = check_run(run_dir, stream=(SEED, SAMPLES, B))
    left = [p for ps in run.pids.values() for p in ps if alive(p)]
    assert left == [], f"workers {left} outlived the launcher"
    return run, log


def check_rejoined(run: LiveRun, log: str, *, steps: int, kill_step: int) -> int:
    """Replica 1, lost at ``kill_step``, was healed and admitted again: every step's members
    are all four before the loss and after the heal step h, and {0, 2, 3} between. Returns h."""
    assert set(run.survivors) == {0, 1, 2, 3}, (run.survivors, log[-4000:])
    assert run.rejoined == (1,), (run.rejoined, run.pids)
    assert len(run.pids[1]) == 2, run.pids
    (healed_at,) = set(run.healed.values())
    for step in range(1, steps + 1):
        want = {0, 1, 2, 3} if step < kill_step or step > healed_at else {0, 2, 3}
        assert set(run.members_at(step)) == want, (step, run.members_at(step))
    return healed_at

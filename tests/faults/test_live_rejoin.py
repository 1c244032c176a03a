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

from pathlib import Path

import pytest
from live_runs import check_rejoined, launch

from lm_resiliency.live.runcheck import LiveRun, check_run

pytestmark = pytest.mark.slow

_STEPS = 40
_KILL_STEP = 4


def _launch(run_dir: Path, *, kill: str = "", faults: str = "") -> LiveRun:
    run, log = launch(run_dir, steps=_STEPS, kill=f"{kill}@{_KILL_STEP}" if kill else "",
                      faults=faults)  # fmt: skip
    check_rejoined(run, log, steps=_STEPS, kill_step=_KILL_STEP)
    assert run.world_full, "no live.world_full record"
    return run


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

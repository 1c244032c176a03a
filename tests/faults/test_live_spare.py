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

import re
from pathlib import Path

import pytest
from live_runs import check_rejoined, launch

from lm_resiliency.live.runcheck import LiveRun, check_run, read_events

pytestmark = pytest.mark.slow

_STEPS = 30
_KILL_STEP = 4


def _launch(run_dir: Path, *, spares: int = 0, kill: str = "", faults: str = "") -> LiveRun:
    run, log = launch(run_dir, steps=_STEPS, kill=f"{kill}@{_KILL_STEP}" if kill else "",
                      faults=faults, spares=spares)  # fmt: skip
    check_rejoined(run, log, steps=_STEPS, kill_step=_KILL_STEP)
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

"""The kill of a live-membership run, from its event logs: when the survivors went on, and why.

:func:`kill_timeline` reads the kill time (``kill-<replica>``, written by the kill point) and
the commit records ``check_run`` collected. The survivors' redo of the step in flight carries
the membership change it adopted (the coordinator's detection and publication wall times, the
adoption and the group rebuild), which splits kill -> first committed step into:

* detection: the kill to the coordinator's detection (a survivor's failed collective flags the
  epoch, or a lease expires);
* agreement: the detection to the survivor adopting the new epoch (acks, publication, adoption);
* group rebuild: the new cross-replica process group;
* step redo: the rest, up to the first commit of the step under the new membership.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lm_resiliency.live.runcheck import LiveRun

from .live_kill import kill_stamp

__all__ = ["KillTimeline", "kill_timeline"]


@dataclass(frozen=True)
class KillTimeline:
    t_kill: float
    first_commit_s: float
    """The kill to the first commit of the step in flight by a survivor."""
    detect_s: float | None
    agree_s: float | None
    rebuild_s: float | None
    redo_s: float | None
    full_world_s: float | None
    """The kill to the first commit by every replica again (``None``: not healed)."""

    def phases(self) -> dict[str, float | None]:
        return {
            "detection": self.detect_s,
            "agreement": self.agree_s,
            "group rebuild": self.rebuild_s,
            "step redo": self.redo_s,
        }


def kill_timeline(run_dir: str | Path, run: LiveRun, killed: int, kill_step: int) -> KillTimeline:
    """The timeline of replica ``killed``'s kill at ``kill_step`` (``AssertionError``)."""
    stamp = kill_stamp(run_dir, killed)
    assert stamp.exists(), f"replica {killed} was not killed ({stamp} is missing)"
    t_kill = float(stamp.read_text())
    assert kill_step in run.commits, f"step {kill_step} was never committed"
    first = min(run.commits[kill_step], key=lambda c: c["ts_ns"])
    t_first = float(first["ts_ns"]) / 1e9
    change = first.get("change") or {}
    detect = agree = rebuild = redo = None
    if "t_detect" in change:
        detect = change["t_detect"] - t_kill
        adopted = change["t_publish"] + change["adopt_s"]
        agree = adopted - change["t_detect"]
        rebuild = change["rebuild_s"]
        redo = t_first - adopted - rebuild
    everyone = set(run.pids)
    full = [
        min(c["ts_ns"] for c in commits) / 1e9
        for step, commits in sorted(run.commits.items())
        if step > kill_step and {c["replica"] for c in commits} == everyone
    ]
    return KillTimeline(
        t_kill=t_kill,
        first_commit_s=t_first - t_kill,
        detect_s=detect,
        agree_s=agree,
        rebuild_s=rebuild,
        redo_s=redo,
        full_world_s=full[0] - t_kill if full else None,
    )

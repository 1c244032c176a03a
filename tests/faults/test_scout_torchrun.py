"""Verified recovery through a real torchrun restart after a layer fault under rotation.

4 workers (tiny GPT, DDP, Gloo) run ``tests/faults/workers/scout_loop.py``: the plain
loop with ``enable_resiliency(..., interval=5, scout=ScoutConfig())``. The GPT's six
blocks are five signatures, checked in turn (wte 5, wpe 10, layer 15, layer 20,
ln_f 25, head 30, wte 35, ...). Rank 2 computes ``ln_f`` wrong from step 27; the
rotation reaches it again at 55 (SDC, rank 2). By then steps 30-50 were captured, but
each only as a candidate: ``ln_f`` had not been checked clean since step 25. Rank 1
then dies (SIGKILL at step 58); torchrun restarts the group, and the restarted job
recovers a verified step from before the onset by itself, bit-identical to what was
captured then.

Which one: 25 is the newest step that meets the rule (verified at 45). The node-local
disk keeps (``keep_generations=2``) the newest two generations, the newest verified one
and the oldest candidate newer than it (the next that can be promoted). The
promotions are written by the trust thread and retention runs on the flusher thread,
so whether 20 or 25 is the one that survived depends on which of them ran first when
step 30 was written; both are verified and captured before the onset.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "scout_loop.py")
_WORLD, _STEPS, _ONSET, _KILL = 4, 60, 27, 58


def test_verified_recovery_after_a_layer_fault_restores_the_pre_onset_step(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--steps", str(_STEPS), "--disk-folder", str(tmp_path / "disk")]
    args += ["--onset", str(_ONSET), "--kill-step", str(_KILL)]
    run = run_torchrun(
        [_WORKER, *args],
        _WORLD,
        max_restarts=1,
        env={"LM_RESILIENCY_RUN_ID": f"scout-{uuid.uuid4().hex[:8]}"},
        timeout_s=420,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == 2, run.describe()
    for rank in range(_WORLD):
        first = json.loads((out / f"boundaries-rank{rank}-attempt0.json").read_text())
        statuses = {int(s): v[1] for s, v in first.items()}
        accepted = (["healthy", []], ["straggler", []])  # a slow replay on this loaded host
        assert all(statuses[s] in accepted for s in range(5, 55, 5)), statuses
        assert statuses[55] == ["sdc", [2]], statuses  # found when the rotation reached ln_f
        start = json.loads((out / f"start-rank{rank}-attempt1.json").read_text())
        step = start["start"]
        assert step in (20, 25), start  # verified, captured before the onset (see above)
        assert start["decision"] == ["sdc", "recovery_verified", step], start
        assert start["restored"] == first[str(step)][0], f"rank {rank}: not bit-identical"
        assert step == json.loads((out / "start-rank0-attempt1.json").read_text())["start"]
        second = json.loads((out / f"boundaries-rank{rank}-attempt1.json").read_text())
        assert all(v[1] in accepted for v in second.values()), second  # the fault is gone


def test_a_crash_while_a_verdict_is_pending_recovers_the_previous_verified_step(
    tmp_path: Path,
) -> None:
    """Pipelined verdict (the default ``ScoutConfig()``), no fault, rank 1 SIGKILLed when it
    draws the batch of step 41: step 40's capture is held and its verdict pending (it
    resolves in the pre-step hook of 41). With a rotation over five recipes, check 35
    verified steps 5 and 10; check 40 would verify 15 and 20, but never resolved. The
    restart, told a machine was lost (``inaccessible``), recovers a verified step: 10 (or
    5, whichever retention kept), bit-identical; never the held 40."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--steps", "45", "--disk-folder", str(tmp_path / "disk")]
    args += ["--onset", "1000000", "--kill-step", "41"]
    run = run_torchrun(
        [_WORKER, *args],
        _WORLD,
        max_restarts=1,
        env={
            "LM_RESILIENCY_RUN_ID": f"scout-pending-{uuid.uuid4().hex[:8]}",
            "LM_RESILIENCY_FAILURE_KIND": "inaccessible",
        },
        timeout_s=420,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == 2, run.describe()
    steps = set()
    for rank in range(_WORLD):
        first = json.loads((out / f"boundaries-rank{rank}-attempt0.json").read_text())
        assert int(max(first, key=int)) == 40, first  # step 40 was trained and held
        start = json.loads((out / f"start-rank{rank}-attempt1.json").read_text())
        step = start["start"]
        assert step in (5, 10), start
        assert start["decision"] == ["inaccessible", "recovery_verified", step], start
        assert start["restored"] == first[str(step)][0], f"rank {rank}: not bit-identical"
        steps.add(step)
    assert len(steps) == 1, steps

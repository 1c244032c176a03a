"""A hang after a real torchrun restart: the restarted job sweeps the saved catalog first.

4 workers (tiny GPT, DDP, Gloo) run ``tests/faults/workers/scout_loop.py`` with
``LM_RESILIENCY_FAILURE_KIND=hang`` (the orchestrator's word), checking every step
(``ScoutConfig(interval=1)``), capturing every 5. The GPT's six blocks are five
recipes, so a capture is verified about a rotation later: at step 20, 15 is
verified and 20 is a candidate. Rank 1 SIGKILLs itself at step 23; torchrun
restarts the group. The restarted process has run no forward, so it has no shapes
of its own: the sweep replays the catalog its predecessor saved with the trust
records.

* clean: the sweep is complete and clean -> the latest step (20), bit-identical;
* a persistent fault (rank 2's ``ln_f`` wrong from step 18, after its clean check
  at 17 and before the next at 23, so the first job never sees it; the device stays
  faulty after the restart): the sweep finds rank 2 -> verified recovery of a step
  captured before the onset, bit-identical.

Before the catalog was saved, both restarted jobs recovered the verified step: the
sweep lacked every shape and was incomplete.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "scout_loop.py")
_WORLD, _STEPS, _KILL = 4, 24, 23


def _run(tmp_path: Path, *extra: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--steps", str(_STEPS), "--disk-folder", str(tmp_path / "disk")]
    # The pipelined verdict (the default): each boundary's verdict is last_scout after the
    # next step, so 20's is on record (read after step 21) before the kill at 23.
    args += ["--kill-step", str(_KILL), "--check-every", "1", *extra]
    env = {"LM_RESILIENCY_RUN_ID": f"sweep-{uuid.uuid4().hex[:8]}"}
    env["LM_RESILIENCY_FAILURE_KIND"] = "hang"
    run = run_torchrun([_WORKER, *args], _WORLD, max_restarts=1, env=env, timeout_s=300)
    assert run.returncode == 0, run.describe()
    assert run.attempts == 2, run.describe()
    starts = [json.loads((out / f"start-rank{r}-attempt1.json").read_text()) for r in range(4)]
    return out, starts


def _captured(out: Path, rank: int) -> dict[str, list]:
    return json.loads((out / f"boundaries-rank{rank}-attempt0.json").read_text())


def test_a_clean_sweep_after_a_restart_recovers_the_latest_step(tmp_path: Path) -> None:
    out, starts = _run(tmp_path, "--onset", "1000")  # no fault
    for rank, start in enumerate(starts):
        assert start["decision"] == ["hang", "latest", 20], start
        assert "complete clean sweep" in start["reason"], start
        assert start["restored"] == _captured(out, rank)["20"][0], f"rank {rank}: not bit-identical"


def test_a_persistent_fault_found_by_the_sweep_recovers_the_verified_step(tmp_path: Path) -> None:
    out, starts = _run(tmp_path, "--onset", "18", "--fault-persists")
    step = starts[0]["start"]
    assert step in (10, 15), starts[0]  # verified and captured before the onset
    for rank, start in enumerate(starts):
        assert start["decision"] == ["hang", "recovery_verified", step], start
        assert "sweep found" in start["reason"], start
        assert "SDC on ranks [2]" in start["reason"], start
        first = _captured(out, rank)
        assert all(v[1][0] in ("healthy", "straggler") for v in first.values()), first
        assert start["restored"] == first[str(step)][0], f"rank {rank}: not bit-identical"

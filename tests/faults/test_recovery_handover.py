"""A recovery that fails while the state is applied leaves the own memory slot attachable.

The README's plain loop under torchrun (2 workers, ``tests/faults/workers/plain_loop.py``)
with a stateful object that refuses the recovered state in the second attempt, as an
adapter's check does (issue 20 item 4: the HF callback's ``ConfigError``):

* attempt 0: rank 1's data stream SIGKILLs its process at step 25 (captures at 10
  and 20 live on in every rank's memory slot files); torchrun restarts the group;
* attempt 1: the recovery loads step 20 from own memory, then applying it raises on
  every rank; the workers die with that error and torchrun restarts them again;
* attempt 2: the recovery must again find step 20 in *own memory* on every rank. Had
  attempt 1 consumed the slots, it would come from the node-local files instead.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "plain_loop.py")
_WORLD = 2


def test_a_recovery_whose_apply_raises_keeps_the_own_slots_for_the_next_start(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--steps", "30", "--disk-folder", str(tmp_path / "disk"),
            "--kill-step", "25", "--kill-rank", "1", "--fail-apply-attempt", "1"]  # fmt: skip
    run = run_torchrun(
        [_WORKER, *args],
        _WORLD,
        max_restarts=2,
        env={"LM_RESILIENCY_RUN_ID": f"handover-{uuid.uuid4().hex[:8]}"},
        timeout_s=300.0,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == 3, run.describe()
    for rank in range(_WORLD):
        assert not (out / f"start-rank{rank}-attempt1.txt").exists()  # apply raised first
        got = json.loads((out / f"sources-rank{rank}-attempt2.json").read_text())
        assert got == {"step": 20, "sources": ["own memory"] * _WORLD}, (rank, got)
        assert (out / f"final-rank{rank}.safetensors").exists()

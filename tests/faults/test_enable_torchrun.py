"""The README's plain loop under the real torchrun agent: SIGKILL of a worker at a random step.

4 workers (tiny GPT, DDP with several buckets, Gloo) run
``tests/faults/workers/plain_loop.py`` -- the loop verbatim, no priming, no
exception handling. In the faulty job one worker's data stream SIGKILLs its
process when asked for the batch of a random step; torchrun restarts the group
(``--max-restarts=1``), ``enable_resiliency`` recovers the newest capture every
rank can load and the job ends bit-identical to a fault-free run.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "plain_loop.py")
_WORLD, _STEPS, _INTERVAL = 4, 40, 10
_TIMEOUT_S = 300.0


def _job(tmp: Path, name: str, kill: tuple[int, int] | None) -> Path:
    out = tmp / name
    out.mkdir()
    args = ["--out", str(out), "--steps", str(_STEPS), "--disk-folder", str(tmp / f"{name}-disk")]
    if kill is not None:
        args += ["--kill-step", str(kill[0]), "--kill-rank", str(kill[1])]
    run = run_torchrun(
        [_WORKER, *args],
        _WORLD,
        max_restarts=1 if kill else 0,
        env={"LM_RESILIENCY_RUN_ID": f"{name}-{uuid.uuid4().hex[:8]}"},
        timeout_s=_TIMEOUT_S,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == (2 if kill else 1), run.describe()
    return out


def test_a_worker_killed_at_a_random_step_resumes_bit_identical(tmp_path: Path) -> None:
    rng = random.Random()
    kill_step, kill_rank = rng.randint(_INTERVAL + 2, _STEPS - 2), rng.randrange(_WORLD)
    context = f"(SIGKILL of rank {kill_rank} at step {kill_step})"
    crashed = _job(tmp_path, "crash", (kill_step, kill_rank))
    reference = _job(tmp_path, "reference", None)
    # The newest capture before the kill, or the one before it when the kill came
    # while that capture was still being replicated.
    newest = (kill_step - 1) // _INTERVAL * _INTERVAL
    for rank in range(_WORLD):
        assert (crashed / f"start-rank{rank}-attempt0.txt").read_text() == "0", context
        start = int((crashed / f"start-rank{rank}-attempt1.txt").read_text())
        assert start in (newest, newest - _INTERVAL), f"start step {start} {context}"
        assert start > 0, context
        final = load_file(str(crashed / f"final-rank{rank}.safetensors"))
        expected = load_file(str(reference / f"final-rank{rank}.safetensors"))
        assert sorted(final) == sorted(expected)
        assert len(final) > 50  # parameters and AdamW state
        differing = [k for k in final if not torch.equal(final[k], expected[k])]
        assert differing == [], f"{differing[:5]} {context}"

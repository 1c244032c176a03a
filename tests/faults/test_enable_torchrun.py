"""The README's plain loop under the real torchrun agent: SIGKILL of a worker at a random step.

4 workers (tiny GPT, DDP with several buckets, Gloo) run
``tests/faults/workers/plain_loop.py`` -- the loop verbatim, no priming, no
exception handling. In the faulty job one worker's data stream SIGKILLs its
process when asked for the batch of a random step; torchrun restarts the group
(``--max-restarts=1``), ``enable_resiliency`` recovers the newest capture every
rank can load and the job ends bit-identical to a fault-free run, its LR
scheduler included (``state=``, stepped after ``optimizer.step()``, no line after
the restore: the capture replays that call). The
fault-free reference runs the same worker code on 4 ranks through
``run_distributed`` (same world, same Gloo collectives; only the launcher differs).
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm_resiliency.testing import run_distributed
from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "plain_loop.py")
_WORLD, _STEPS, _INTERVAL = 4, 40, 10
_TIMEOUT_S = 300.0


def _args(tmp: Path, name: str) -> list[str]:
    out = tmp / name
    out.mkdir()
    disk = str(tmp / f"{name}-disk")
    return ["--out", str(out), "--steps", str(_STEPS), "--disk-folder", disk, "--scheduler"]


def _crash_job(tmp: Path, kill_step: int, kill_rank: int) -> Path:
    args = [*_args(tmp, "crash"), "--kill-step", str(kill_step), "--kill-rank", str(kill_rank)]
    run = run_torchrun(
        [_WORKER, *args],
        _WORLD,
        max_restarts=1,
        env={"LM_RESILIENCY_RUN_ID": f"crash-{uuid.uuid4().hex[:8]}"},
        timeout_s=_TIMEOUT_S,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == 2, run.describe()
    return tmp / "crash"


def _reference_rank(rank: int, world: int, args: list[str]) -> None:
    from workers import plain_loop

    plain_loop.train(args)


def _reference_job(tmp: Path) -> Path:
    run_distributed(_reference_rank, _WORLD, args=(_args(tmp, "reference"),), timeout_s=240)
    return tmp / "reference"


def test_a_worker_killed_at_a_random_step_resumes_bit_identical(tmp_path: Path) -> None:
    rng = random.Random()
    kill_step, kill_rank = rng.randint(_INTERVAL + 2, _STEPS - 2), rng.randrange(_WORLD)
    context = f"(SIGKILL of rank {kill_rank} at step {kill_step})"
    crashed = _crash_job(tmp_path, kill_step, kill_rank)
    reference = _reference_job(tmp_path)
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
        # The LR scheduler (state=, stepped after optimizer.step(), nothing after the
        # restore) ends where the fault-free run's does, learning rate bit for bit.
        got = json.loads((crashed / f"scheduler-rank{rank}.json").read_text())
        want = json.loads((reference / f"scheduler-rank{rank}.json").read_text())
        assert got == want and got["scheduler"]["last_epoch"] == _STEPS, context

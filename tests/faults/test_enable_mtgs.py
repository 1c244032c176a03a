"""GEMINI + MTGS through enable_resiliency under torchrun: an abort, a crash, one result.

2 workers run ``tests/faults/workers/mtgs_loop.py`` (every step
``resiliency.train_step(...)``, captures every 10 steps). In the faulty job
rank 1's gradient turns NaN at step 7 (MTGS aborts the step on both ranks and
retries it; nothing is captured of the aborted attempt) and rank 0 is
SIGKILLed in the middle of step 23's backward pass (torchrun restarts the
group, GEMINI recovers step 20). The job ends bit-identical to a fault-free one.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "mtgs_loop.py")
_WORLD, _STEPS = 2, 30


def _job(tmp: Path, name: str, faults: str) -> Path:
    out = tmp / name
    out.mkdir()
    args = ["--out", str(out), "--steps", str(_STEPS), "--disk-folder", str(tmp / f"{name}-d")]
    run = run_torchrun(
        [_WORKER, *args, *(["--faults", faults] if faults else [])],
        _WORLD,
        max_restarts=1 if faults else 0,
        env={"LM_RESILIENCY_RUN_ID": f"{name}-{uuid.uuid4().hex[:8]}"},
        timeout_s=300,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == (2 if faults else 1), run.describe()
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("mtgs")
    return {
        "faulty": _job(tmp, "faulty", "nan_grad@1:7,sigkill@0:23"),
        "reference": _job(tmp, "reference", ""),
    }


def _read(out: Path, what: str, rank: int, attempt: int) -> str:
    return (out / f"{what}-rank{rank}-attempt{attempt}.txt").read_text()


def test_the_nan_step_is_retried_and_the_killed_job_resumes_after_step_20(
    jobs: dict[str, Path],
) -> None:
    for rank in range(_WORLD):
        assert _read(jobs["faulty"], "start", rank, 0) == "0"
        assert json.loads(_read(jobs["faulty"], "retried", rank, 0)) == {"7": ["nonfinite_grad"]}
        assert _read(jobs["faulty"], "start", rank, 1) == "20"
        assert json.loads(_read(jobs["faulty"], "retried", rank, 1)) == {}
        assert json.loads(_read(jobs["reference"], "retried", rank, 0)) == {}


def test_the_faulty_job_ends_bit_identical_to_the_fault_free_one(jobs: dict[str, Path]) -> None:
    for rank in range(_WORLD):
        final = load_file(str(jobs["faulty"] / f"final-rank{rank}.safetensors"))
        expected = load_file(str(jobs["reference"] / f"final-rank{rank}.safetensors"))
        assert sorted(final) == sorted(expected)
        assert len(final) > 50
        assert [k for k in final if not torch.equal(final[k], expected[k])] == []

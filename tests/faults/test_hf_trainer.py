"""A Hugging Face Trainer with ResiliencyCallback under torchrun: SIGKILL, restart, same weights.

2 workers train a tiny randomly initialised GPT-2 (built from a config; nothing
downloaded, ``HF_HUB_OFFLINE=1``) for 20 steps with dropout, a linear warm-up
schedule and a shuffling sampler; GEMINI captures every 5 steps. In the faulty
job rank 1's dataset SIGKILLs its process in the middle of step 13; torchrun
restarts both workers, the callback restores step 10 (model, AdamW, scheduler,
Trainer state, RNG, data position) on train begin without
``resume_from_checkpoint``, and the final weights equal a fault-free run's.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "hf_trainer.py")
# 4 samples per batch; the 50th fetch on rank 1 is the second sample of step 13's batch
_KILL_AT = 50


def _job(tmp: Path, name: str, kill: bool) -> Path:
    out = tmp / name
    out.mkdir()
    args = ["--out", str(out), "--steps", "20", "--disk-folder", str(tmp / f"{name}-disk")]
    run = run_torchrun(
        [_WORKER, *args, *(["--kill-at", str(_KILL_AT)] if kill else [])],
        2,
        max_restarts=1 if kill else 0,
        env={"LM_RESILIENCY_RUN_ID": f"{name}-{uuid.uuid4().hex[:8]}", "HF_HUB_OFFLINE": "1"},
        timeout_s=300,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == (2 if kill else 1), run.describe()
    return out


def test_a_killed_trainer_resumes_on_train_begin_with_bit_identical_weights(
    tmp_path: Path,
) -> None:
    crashed = _job(tmp_path, "crash", kill=True)
    reference = _job(tmp_path, "reference", kill=False)
    for rank in range(2):
        assert (crashed / f"start-rank{rank}-attempt1.txt").read_text() == "10"
        assert (reference / f"start-rank{rank}-attempt0.txt").read_text() == "0"
    final = load_file(str(crashed / "final.safetensors"))
    expected = load_file(str(reference / "final.safetensors"))
    assert sorted(final) == sorted(expected)
    assert len(final) > 20
    assert [k for k in final if not torch.equal(final[k], expected[k])] == []

"""A Hugging Face Trainer with ResiliencyCallback under torchrun: SIGKILL, restart, same weights.

2 workers train a tiny randomly initialised GPT-2 (built from a config; nothing
downloaded, ``HF_HUB_OFFLINE=1``) for 20 steps with dropout, a linear warm-up
schedule and a shuffling sampler; GEMINI captures every 5 steps. In the faulty
job rank 1's dataset SIGKILLs its process in step 14; torchrun restarts both
workers, the callback restores step 10 (or 5, when step 10 had not reached the
node-local disk yet; model, AdamW, scheduler,
Trainer state, RNG, data position) on train begin without
``resume_from_checkpoint``, and the final weights equal a fault-free run's, as
do what ``train()`` reports: ``train_loss`` (the mean over all 20 steps),
``state.epoch`` and ``total_flos``.

A user's ``train(resume_from_checkpoint=...)`` wins over GEMINI: the restarted
job resumes from the Trainer's checkpoint of step 3 although GEMINI holds a
newer step. A ``max_steps`` whose captures would lie past the first pass over
the data is refused at train begin, before any step.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).parent / "workers" / "hf_trainer.py")
# 4 samples per batch (the loader fetches one batch ahead): the 58th fetch is in step 14
_KILL_AT = 58


def _job(tmp: Path, name: str, kill: bool, *extra: str) -> Path:
    out = tmp / name
    out.mkdir()
    args = ["--out", str(out), "--steps", "20", "--disk-folder", str(tmp / f"{name}-disk")]
    args += extra
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
        # Until GEMINI slots outlive the process, the restarted workers read node-local
        # disk, where the capture of step 10 may still be on its way.
        assert (crashed / f"start-rank{rank}-attempt1.txt").read_text() in ("10", "5")
        assert (reference / f"start-rank{rank}-attempt0.txt").read_text() == "0"
    final = load_file(str(crashed / "final.safetensors"))
    expected = load_file(str(reference / "final.safetensors"))
    assert sorted(final) == sorted(expected)
    assert len(final) > 20
    assert [k for k in final if not torch.equal(final[k], expected[k])] == []
    for rank in range(2):
        resumed = _metrics(crashed, rank, attempt=1)
        fault_free = _metrics(reference, rank, attempt=0)
        # train_loss averages all 20 steps, the epoch counts the skipped batches, the FLOs
        # of the steps before the capture are kept: all exactly as without the fault.
        for key in ("train_loss", "epoch", "total_flos", "global_step"):
            assert resumed[key] == fault_free[key], (rank, key, resumed[key], fault_free[key])
        assert resumed["source"] == "gemini"


def _metrics(out: Path, rank: int, *, attempt: int) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(
        (out / f"metrics-rank{rank}-attempt{attempt}.json").read_text()
    )
    return loaded


def test_resume_from_checkpoint_wins_over_a_newer_gemini_step(tmp_path: Path) -> None:
    # The Trainer saves checkpoints at 3, 6, 9, 12; GEMINI captures 5 and 10; killed in
    # step 14. The restarted job passes resume_from_checkpoint=checkpoint-3.
    resumed = _job(tmp_path, "resume", True, "--save-steps", "3", "--resume-step", "3")
    for rank in range(2):
        assert (resumed / f"start-rank{rank}-attempt1.txt").read_text() == "3"
        metrics = _metrics(resumed, rank, attempt=1)
        assert (metrics["source"], metrics["global_step"]) == ("fallback", 20)


def test_a_run_past_the_first_pass_is_refused_before_any_step(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from lm_resiliency.hf import ResiliencyCallback

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(16) % 64
            return {"input_ids": ids, "labels": ids}

    gpt = GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=1)
    model = GPT2LMHeadModel(gpt)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=12,  # 8 batches per pass: the capture of step 10 lies in the second
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    config = InMemoryCkptConfig(disk_folder=tmp_path / "disk", run_id="first-pass")
    trainer.add_callback(ResiliencyCallback(trainer, interval=5, config=config))
    with pytest.raises(ConfigError, match=r"max_steps=12 .*step 10 .*8 batches.*at most 7 steps"):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first step

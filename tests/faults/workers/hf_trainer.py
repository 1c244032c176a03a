"""torchrun worker: a Hugging Face Trainer with ResiliencyCallback, nothing else changed.

``... tests/faults/workers/hf_trainer.py --out DIR --steps N --disk-folder DIR
[--kill-at K --kill-rank R] [--save-steps S --resume-step C]``

A tiny GPT-2 built from a config (random weights, nothing downloaded) trains
on a synthetic dataset. With ``--kill-at``, rank R's dataset SIGKILLs its
process at its K-th sample fetch in the job's first generation (the machine
dies; torchrun restarts the group). Rank 0 writes the final weights to
``DIR/final.safetensors``; every rank its start step per attempt and what
``train()`` reported (``train_loss``, ``epoch``, ``total_flos``, the recovery
source) to ``DIR/metrics-rank<R>-attempt<A>.json``. With ``--save-steps`` the
Trainer also saves its own checkpoints (``DIR/hf``); with ``--resume-step``
the restarted generation calls ``train(resume_from_checkpoint=DIR/hf/checkpoint-C)``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.distributed import init_process_group, restart_count
from lm_resiliency.hf import ResiliencyCallback


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, kill_at: int | None) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.kill_at = kill_at
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched += 1
        if self.kill_at is not None and self.fetched == self.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--disk-folder", type=Path, required=True)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume-step", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    init_process_group("gloo")  # before the Trainer: survives torchrun restarts
    rank, attempt = int(os.environ["RANK"]), restart_count() or 0
    dies = a.kill_at and attempt == 0 and rank == a.kill_rank
    dataset = Tokens(256, a.kill_at if dies else None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir=str(a.out / ("hf" if a.save_steps else f"hf-{rank}")),
        max_steps=a.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=3,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=11,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    config = InMemoryCkptConfig(disk_folder=a.disk_folder, disk_flush_interval=5)
    callback = ResiliencyCallback(trainer, interval=5, config=config)
    trainer.add_callback(callback)
    resume = None
    if a.resume_step and attempt > 0:
        resume = str(a.out / "hf" / f"checkpoint-{a.resume_step}")
    result = trainer.train(resume_from_checkpoint=resume)

    start = callback.last_start_step
    (a.out / f"start-rank{rank}-attempt{attempt}.txt").write_text(str(start))
    metrics = {
        "train_loss": result.metrics["train_loss"],
        "total_flos": trainer.state.total_flos,
        "epoch": trainer.state.epoch,
        "global_step": trainer.state.global_step,
        "source": getattr(getattr(callback, "last_recovery", None), "source", None),
    }
    (a.out / f"metrics-rank{rank}-attempt{attempt}.json").write_text(json.dumps(metrics))
    if rank == 0:
        weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(a.out / "final.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

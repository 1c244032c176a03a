"""A Hugging Face Trainer with ResiliencyCallback: no resume_from_checkpoint needed.

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 --rdzv-id my-run examples/hf_trainer.py

Needs the hf extra (``pip install 'lm-resiliency[hf]'``). A tiny GPT-2 built
from a config (random weights, nothing downloaded) trains on random tokens.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.distributed import init_process_group
from lm_resiliency.hf import ResiliencyCallback


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


init_process_group("gloo")  # before the Trainer: survives torchrun restarts
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="/tmp/lm-resiliency-example-hf", max_steps=100,
                         per_device_train_batch_size=4, save_strategy="no", report_to=[],
                         use_cpu=True, ddp_backend="gloo")  # fmt: skip
trainer = Trainer(model=model, args=args, train_dataset=Tokens(1024))
config = InMemoryCkptConfig(disk_folder="/tmp/lm-resiliency-example-hf/gemini")
trainer.add_callback(ResiliencyCallback(trainer, interval=10, config=config))
trainer.train()

"""GEMINI + MTGS: every step a transaction, captures of committed steps only.

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 --rdzv-id my-run examples/mtgs.py

A bad step (non-finite gradients, an exception or OOM inside the step) is
aborted on every rank and retried with the same batches and random numbers;
a crash is recovered by GEMINI. Gradients are accumulated over 2 micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, MTGSConfig, enable_resiliency
from lm_resiliency.distributed import init_process_group
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
max_steps, micro_batches = 100, 2


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss: torch.Tensor = model(inputs, targets)
    return loss


init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
ddp_model = DDP(TinyGPT(MODEL))
optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
loader = SyntheticTokens(0, 8, 32, MODEL.vocab_size, rank=rank, world_size=world)
torch.manual_seed(1 + rank)
config = InMemoryCkptConfig(disk_folder="/tmp/lm-resiliency-example-mtgs", disk_flush_interval=50)

# The scheduler in `state` is stepped by the transaction on commit (do not step it yourself).
resiliency = enable_resiliency(ddp_model, optimizer, interval=10, config=config,
                               state={"loader": loader, "scheduler": scheduler},
                               mtgs=MTGSConfig(max_retries=2))  # fmt: skip
for step in range(resiliency.start_step + 1, max_steps + 1):
    result = resiliency.train_step(lambda i: loss_fn(ddp_model, next(loader)) / micro_batches,
                                   micro_batches=micro_batches)  # fmt: skip
    if result.retries and rank == 0:
        print(f"step {step}: retried after {result.reasons}")
resiliency.close()
dist.destroy_process_group()

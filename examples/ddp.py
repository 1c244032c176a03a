"""Plain PyTorch DDP training with enable_resiliency: the loop stays the plain one.

    torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 --rdzv-id my-run examples/ddp.py

Kill any worker (``kill -9``) while it trains: torchrun restarts the group and
the job resumes after the newest capture every rank can load, bit-identical to
a run without the fault. CPU and Gloo; nothing to download.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.distributed import init_process_group
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
max_steps = 200


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss: torch.Tensor = model(inputs, targets)
    return loss


init_process_group("gloo")  # survives torchrun restarts (see docs/launching.md)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
ddp_model = DDP(TinyGPT(MODEL))
optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
loader = SyntheticTokens(0, 8, 32, MODEL.vocab_size, rank=rank, world_size=world)
torch.manual_seed(1 + rank)  # dropout differs per rank
config = InMemoryCkptConfig(disk_folder="/tmp/lm-resiliency-example", disk_flush_interval=50)

resiliency = enable_resiliency(ddp_model, optimizer, interval=10, state={"loader": loader},
                               config=config)  # fmt: skip
for step in range(resiliency.start_step + 1, max_steps + 1):
    loss_fn(ddp_model, next(loader)).backward()
    optimizer.step()
    optimizer.zero_grad()
resiliency.close()

if rank == 0:
    print(f"trained to step {max_steps}; resumed after step {resiliency.start_step}")
dist.destroy_process_group()

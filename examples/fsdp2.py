"""FSDP2 (``fully_shard``) or HSDP training with enable_resiliency.

    torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 --rdzv-id my-run examples/fsdp2.py [--hsdp]

Each rank captures its own shards and sharded optimizer state (nothing is
gathered). With ``--hsdp`` the 2 x 2 mesh's replicas already hold every shard
twice, so GEMINI keeps two own slots and sends nothing to a peer.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.distributed import init_process_group
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
max_steps = 200


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss: torch.Tensor = model(inputs, targets)
    return loss


init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if "--hsdp" in sys.argv:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
else:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = TinyGPT(MODEL)
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = SyntheticTokens(0, 8, 32, MODEL.vocab_size, rank=rank, world_size=world)
torch.manual_seed(1 + rank)
config = InMemoryCkptConfig(disk_folder="/tmp/lm-resiliency-example-fsdp", disk_flush_interval=50)

resiliency = enable_resiliency(model, optimizer, interval=10, state={"loader": loader},
                               config=config)  # fmt: skip
for step in range(resiliency.start_step + 1, max_steps + 1):
    loss_fn(model, next(loader)).backward()
    optimizer.step()
    optimizer.zero_grad()
resiliency.close()

if rank == 0:
    print(f"{resiliency.adapter.framework}: trained to step {max_steps}; "
          f"resumed after step {resiliency.start_step}")  # fmt: skip
dist.destroy_process_group()

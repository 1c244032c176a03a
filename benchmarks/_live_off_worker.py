"""benchmarks/live.py's "off" job: the same 4 processes as one plain torchrun DDP + MTGS job.

The demo model, the same dataset and global batch as ``lm_resiliency.demo.live_worker``, each
rank drawing its fixed share of every step (``GlobalBatchSampler`` with index=rank,
count=world). Rank 0 writes the steps/s after ``--warmup`` steps to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lm_resiliency import MTGSConfig, enable_resiliency
from lm_resiliency.demo.live_worker import SAMPLES, dataset
from lm_resiliency.demo.training import MODEL
from lm_resiliency.distributed import init_process_group
from lm_resiliency.live.sampler import GlobalBatchSampler, Share
from lm_resiliency.models import TinyGPT


class _Fixed:
    def __init__(self, index: int, count: int) -> None:
        self.step, self.index, self.count = 1, index, count

    def current(self) -> Share:
        return Share(step=self.step, index=self.index, count=self.count)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(MODEL), bucket_cap_mb=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = enable_resiliency(model, optimizer, interval=5, mtgs=MTGSConfig())
    source = _Fixed(rank, world)
    sampler = GlobalBatchSampler(SAMPLES, args.global_batch, 0, source, steps=args.steps)
    batches = iter(DataLoader(dataset(0), batch_sampler=sampler, num_workers=0))

    def loss() -> torch.Tensor:
        inputs, targets = next(batches)
        out: torch.Tensor = model(inputs, targets)
        return out

    t0 = 0.0
    for step in range(1, args.steps + 1):
        source.step = step
        handle.train_step(loss)
        if step == args.warmup:
            t0 = time.perf_counter()
    rate = (args.steps - args.warmup) / (time.perf_counter() - t0)
    handle.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"steps_per_s": rate}, f)


if __name__ == "__main__":
    main()

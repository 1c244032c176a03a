"""The live-membership demo's training script: the plain MTGS loop under ``lm-resiliency launch``.

    lm-resiliency launch --replica-groups 4 --nproc-per-group 1 -- \\
        -m lm_resiliency.demo.live_worker --steps 20 --global-batch 16

Every replica group is one process (N=1) holding the demo's tiny GPT under DDP on its own
size-1 group; ``enable_resiliency(..., mtgs=MTGSConfig(), live=LiveConfig(...))`` reduces the
gradients across the replica groups and survives the loss of one. The data is a plain
``DataLoader`` over a fixed dataset with ``batch_sampler=handle.sampler(...)``; the batch is
drawn inside the step closure, so a step redone under a new membership re-splits the same
global batch. No exception handling: a survivor never sees the loss of a peer.

``LMR_LIVE_EVENTS`` (a folder) receives each replica's event log (commits, samples, changes);
``--faults`` takes a fault schedule numbered by replica (``leave@1:6``), armed by
``LM_RESILIENCY_FAULTS=1``. ``--lease-s`` etc. set the ``LiveConfig`` timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lm_resiliency import MTGSConfig, enable_resiliency
from lm_resiliency.distributed import init_process_group
from lm_resiliency.faults import FaultInjector, FaultSchedule
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.models import TinyGPT

from .training import MODEL, SEQ_LEN

__all__ = ["build_parser", "main"]

SAMPLES = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lm_resiliency.demo.live_worker")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default="", help="fault schedule by replica, e.g. leave@1:6")
    p.add_argument("--heartbeat-s", type=float, default=0.1)
    p.add_argument("--lease-s", type=float, default=0.5)
    p.add_argument("--stale-s", type=float, default=0.25)
    p.add_argument("--reform-timeout-s", type=float, default=5.0)
    p.add_argument("--coordinator-timeout-s", type=float, default=3.0)
    p.add_argument("--join-timeout-s", type=float, default=600.0)
    p.add_argument("--digest-every", type=int, default=1)
    p.add_argument(
        "--step-sleep-s",
        type=float,
        default=0.0,
        help="sleep this long in every forward (stands in for a real step's compute)",
    )
    return p


def dataset(seed: int) -> TensorDataset:
    """A fixed corpus of token sequences (the same in every replica)."""
    g = torch.Generator().manual_seed(seed + 12345)
    tokens = torch.randint(0, MODEL.vocab_size, (SAMPLES, SEQ_LEN + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_process_group("gloo")  # this replica group's own world (N ranks of its torchrun)
    torch.manual_seed(args.seed)
    net = TinyGPT(MODEL)
    model = DistributedDataParallel(net, bucket_cap_mb=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    live = LiveConfig(
        heartbeat_s=args.heartbeat_s,
        lease_s=args.lease_s,
        stale_s=args.stale_s,
        reform_timeout_s=args.reform_timeout_s,
        coordinator_timeout_s=args.coordinator_timeout_s,
        join_timeout_s=args.join_timeout_s,
        digest_every=args.digest_every,
    )
    faults = None
    if args.faults:
        faults = FaultInjector(
            # A warm spare has no replica yet: the front door renumbers it for the one it takes.
            FaultSchedule.parse(args.faults),
            rank=int(os.environ.get("LMR_REPLICA_GROUP", "0")),
        )
    handle = enable_resiliency(
        model, optimizer, interval=5, mtgs=MTGSConfig(), live=live, faults=faults
    )
    data = dataset(args.seed)
    sampler = handle.sampler(args.global_batch, len(data), args.seed, steps=args.steps)
    batches = iter(DataLoader(data, batch_sampler=sampler, num_workers=0))

    def loss() -> torch.Tensor:
        inputs, targets = next(batches)
        out: torch.Tensor = model(inputs, targets)
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)
        return out

    for _ in range(handle.start_step + 1, args.steps + 1):
        handle.train_step(loss)
    handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

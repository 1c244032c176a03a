"""torchrun worker: GEMINI + MTGS through enable_resiliency, every step a transaction.

``... tests/faults/workers/mtgs_loop.py --out DIR --steps N --disk-folder DIR
[--faults SPEC]``

The loop is the documented MTGS form of the plain loop. ``--faults`` (the
fault injector's ``KIND@RANK:STEP`` schedule, e.g. ``nan_grad@1:7,sigkill@0:23``)
is given to ``enable_resiliency(faults=...)`` in the job's first generation
only (it installs the injector's hooks): the faulty device, not the loop.
Every rank writes its final parameters and optimizer state to
``DIR/final-rank<R>.safetensors``, its start step per attempt and the steps
that needed a retry to ``DIR/retried-rank<R>-attempt<A>.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, MTGSConfig, enable_resiliency
from lm_resiliency.distributed import restart_count
from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import SyntheticTokens, TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script and as workers.<name>
from _loop_common import MODEL, loss_fn, main, save_final


def train(argv: list[str]) -> None:
    """The whole worker after the process group exists (also run by run_distributed)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--disk-folder", type=Path, required=True)
    p.add_argument("--faults", default="")
    args = p.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count() or 0
    torch.manual_seed(0)
    ddp_model = DDP(TinyGPT(MODEL), bucket_cap_mb=0.02)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
    loader = SyntheticTokens(0, 4, 16, MODEL.vocab_size, rank=rank, world_size=world)
    torch.manual_seed(1 + rank)
    max_steps = args.steps
    config = InMemoryCkptConfig(disk_folder=args.disk_folder, disk_flush_interval=10)

    injector = None
    if args.faults and attempt == 0:
        injector = FaultInjector(args.faults, rank=rank)
        injector.arm()
    resiliency = enable_resiliency(
        ddp_model, optimizer, interval=10, state={"loader": loader}, config=config,
        mtgs=MTGSConfig(max_retries=2), faults=injector,
    )  # fmt: skip
    (args.out / f"start-rank{rank}-attempt{attempt}.txt").write_text(str(resiliency.start_step))
    retried: dict[int, list[str]] = {}
    for step in range(resiliency.start_step + 1, max_steps + 1):
        result = resiliency.train_step(lambda: loss_fn(ddp_model, next(loader)))
        if result.retries:
            retried[step] = [n for names in result.reasons.values() for n in names]
        (args.out / f"retried-rank{rank}-attempt{attempt}.txt").write_text(json.dumps(retried))
    resiliency.close()

    save_final(args.out, rank, ddp_model, optimizer)


if __name__ == "__main__":
    sys.exit(main(train))

"""torchrun worker: GEMINI + MTGS through enable_resiliency, every step a transaction.

``... tests/faults/workers/mtgs_loop.py --out DIR --steps N --disk-folder DIR
[--faults SPEC]``

The loop is the documented MTGS form of the plain loop. ``--faults`` (the
fault injector's ``KIND@RANK:STEP`` schedule, e.g. ``nan_grad@1:7,sigkill@0:23``)
is attached to the transaction in the job's first generation only: the faulty
device, not the loop. Every rank writes its final parameters and optimizer
state to ``DIR/final-rank<R>.safetensors``, its start step per attempt and the
steps that needed a retry to ``DIR/retried-rank<R>-attempt<A>.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, MTGSConfig, enable_resiliency
from lm_resiliency.distributed import init_process_group, restart_count
from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss: torch.Tensor = model(inputs, targets)
    return loss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--disk-folder", type=Path, required=True)
    p.add_argument("--faults", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count() or 0
    torch.manual_seed(0)
    ddp_model = DDP(TinyGPT(MODEL), bucket_cap_mb=0.02)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
    loader = SyntheticTokens(0, 4, 16, MODEL.vocab_size, rank=rank, world_size=world)
    torch.manual_seed(1 + rank)
    max_steps = args.steps
    config = InMemoryCkptConfig(disk_folder=args.disk_folder, disk_flush_interval=10)

    resiliency = enable_resiliency(
        ddp_model, optimizer, interval=10, state={"loader": loader}, config=config,
        mtgs=MTGSConfig(max_retries=2),
    )  # fmt: skip
    if args.faults and attempt == 0:
        assert resiliency.mtgs is not None
        injector = FaultInjector(args.faults, rank=rank)
        injector.arm()
        injector.install(ddp_model.module, optimizer)
        resiliency.mtgs.faults = injector
    (args.out / f"start-rank{rank}-attempt{attempt}.txt").write_text(str(resiliency.start_step))
    retried: dict[int, list[str]] = {}
    for step in range(resiliency.start_step + 1, max_steps + 1):
        result = resiliency.train_step(lambda: loss_fn(ddp_model, next(loader)))
        if result.retries:
            retried[step] = [n for names in result.reasons.values() for n in names]
        (args.out / f"retried-rank{rank}-attempt{attempt}.txt").write_text(json.dumps(retried))
    resiliency.close()

    final = {f"param/{n}": t.detach().clone() for n, t in ddp_model.module.named_parameters()}
    names = {id(t): n for n, t in ddp_model.module.named_parameters()}
    for param, st in optimizer.state.items():
        for key, value in st.items():
            final[f"optim/{names[id(param)]}/{key}"] = value.detach().clone().reshape(-1)
    save_file(final, str(args.out / f"final-rank{rank}.safetensors"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun worker: the plain training loop of the README, verbatim, under enable_resiliency.

``python -m torch.distributed.run ... tests/faults/workers/plain_loop.py --out DIR
--steps N --disk-folder DIR [--kill-step S --kill-rank R] [--fail-apply-attempt A]
[--scheduler]``

With ``--scheduler`` the loop also steps an LR scheduler (in ``state=``) right
after ``optimizer.step()``, the torch order, and nothing follows the restore: the
capture replays that call. Its final state goes to ``DIR/scheduler-rank<R>.json``.

The fault is not in the loop: it is in the data source. With ``--kill-step``,
rank R's batch stream SIGKILLs its own process when training asks it for the
batch of step S in the job's first generation (a machine that dies while
training; torchrun then restarts the whole group). Every rank writes its final
parameters and optimizer state to ``DIR/final-rank<R>.safetensors`` and its
start step to ``DIR/start-rank<R>-attempt<A>.txt`` and the recovery's sources to
``DIR/sources-rank<R>-attempt<A>.json``. With ``--fail-apply-attempt A`` a stateful
object of the job refuses the recovered state in attempt A (its ``load_state_dict``
raises, as an adapter's check would), so that attempt dies inside the recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.distributed import restart_count
from lm_resiliency.models import SyntheticTokens, TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script and as workers.<name>
from _loop_common import MODEL, loss_fn, main, save_final


class DyingTokens(SyntheticTokens):
    """The synthetic stream, except that it kills its process at one batch (first generation)."""

    def __init__(self, *args: Any, kill_at: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_at = kill_at

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kill_at is not None and self.position + 1 == self.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__next__()


class RefusingProbe:
    """A stateful object whose ``load_state_dict`` raises in one attempt (a failing apply)."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.applied = 0

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse:
            raise RuntimeError("RefusingProbe: this attempt refuses the recovered state")
        self.applied = int(state["applied"]) + 1


def train(argv: list[str]) -> None:
    """The whole worker after the process group exists (also run by run_distributed)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--disk-folder", type=Path, required=True)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--fail-apply-attempt", type=int, default=-1)
    p.add_argument("--scheduler", action="store_true")
    args = p.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count() or 0
    torch.manual_seed(0)
    ddp_model = DDP(TinyGPT(MODEL), bucket_cap_mb=0.02)  # several buckets
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
    dies = args.kill_step and attempt == 0 and rank == args.kill_rank
    loader = DyingTokens(
        0, 4, 16, MODEL.vocab_size, rank=rank, world_size=world,
        kill_at=args.kill_step if dies else None,
    )  # fmt: skip
    torch.manual_seed(1 + rank)  # dropout masks differ per rank
    max_steps = args.steps
    config = InMemoryCkptConfig(disk_folder=args.disk_folder, disk_flush_interval=10)

    state: dict[str, Any] = {"loader": loader}
    scheduler = None
    if args.scheduler:  # the LR changes at every step: a restore one step behind shows
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
        state["scheduler"] = scheduler
    if args.fail_apply_attempt >= 0:
        state["probe"] = RefusingProbe(refuse=attempt == args.fail_apply_attempt)
    resiliency = enable_resiliency(ddp_model, optimizer, interval=10, state=state, config=config)
    (args.out / f"start-rank{rank}-attempt{attempt}.txt").write_text(str(resiliency.start_step))
    recovered = resiliency.last_recovery
    (args.out / f"sources-rank{rank}-attempt{attempt}.json").write_text(
        json.dumps({"step": recovered.step, "sources": list(recovered.sources)})
    )
    for step in range(resiliency.start_step + 1, max_steps + 1):
        loss_fn(ddp_model, next(loader)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    resiliency.close()

    if scheduler is not None:
        lrs = [g["lr"] for g in optimizer.param_groups]
        done = {"scheduler": scheduler.state_dict(), "lr": lrs}
        (args.out / f"scheduler-rank{rank}.json").write_text(json.dumps(done))

    save_final(args.out, rank, ddp_model, optimizer)


if __name__ == "__main__":
    sys.exit(main(train))

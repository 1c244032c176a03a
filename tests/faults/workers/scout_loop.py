"""torchrun worker: the plain loop with SCOUT (``ScoutConfig()``), a persistent SDC, a crash.

``python -m torch.distributed.run ... tests/faults/workers/scout_loop.py --out DIR
--steps N --disk-folder DIR --onset S --kill-step K [--check-every C] [--sync] [--fault-persists]``

In the job's first generation rank 2 computes the GPT's final norm (``ln_f``, a
signature of its own) wrong from step S on; SCOUT finds it when the rotation
reaches that block, the captures after it are skipped, and at step K rank 1's
batch stream SIGKILLs its own process (torchrun then restarts the group). Every
rank writes, per attempt, the digest of its model and optimizer state at every
capture boundary (``DIR/boundaries-rank<R>-attempt<A>.json``) and, after
``enable_resiliency``, the recovery decision and the digest of the restored state
(``DIR/start-rank<R>-attempt<A>.json``).

``--check-every C`` checks every C steps (``ScoutConfig(interval=C)``; default: at
each capture). ``--fault-persists``: the device stays faulty after the restart
(rank 2's ``ln_f`` is wrong from the restarted process's first call, so the
recovery's sweep replays it wrong too). ``--onset`` beyond ``--steps``: no fault.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, ScoutConfig, enable_resiliency
from lm_resiliency.distributed import restart_count
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.models import TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script and as workers.<name>
from _loop_common import MODEL, loss_fn, main
from plain_loop import DyingTokens

INTERVAL = 5


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the parameters, buffers and optimizer tensors (bit identity)."""
    h = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _faulty_ln_f(model: TinyGPT, optimizer: torch.optim.Optimizer, rank: int, onset: int) -> None:
    """Rank 2 computes the final norm wrong once ``onset`` optimizer steps completed."""
    faults = ComputeFaults([PersistentSDC(rank=2, module=model.ln_f, from_step=onset)], rank=rank)
    faults.arm()
    faults.install(optimizer)


def train(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--disk-folder", type=Path, required=True)
    p.add_argument("--onset", type=int, required=True)
    p.add_argument("--kill-step", type=int, required=True)
    p.add_argument("--check-every", type=int, default=None)
    p.add_argument("--sync", action="store_true", help="ScoutConfig(pipeline=False)")
    p.add_argument("--fault-persists", action="store_true")
    args = p.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count() or 0
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    ddp_model = DDP(model)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
    dies = attempt == 0 and rank == 1
    loader = DyingTokens(
        0, 4, 16, MODEL.vocab_size, rank=rank, world_size=world,
        kill_at=args.kill_step if dies else None,
    )  # fmt: skip
    torch.manual_seed(1 + rank)
    config = InMemoryCkptConfig(disk_folder=args.disk_folder, disk_flush_interval=0)
    if attempt > 0 and args.fault_persists:
        _faulty_ln_f(model, optimizer, rank, 0)  # before the recovery: its sweep runs here
    resiliency = enable_resiliency(
        ddp_model,
        optimizer,
        interval=INTERVAL,
        state={"loader": loader},
        config=config,
        # The pipelined verdict is the default; --sync decides each check at its boundary.
        scout=ScoutConfig(interval=args.check_every, pipeline=not args.sync),
    )
    decision = resiliency.last_recovery.decision
    start = {
        "start": resiliency.start_step,
        "restored": state_digest(model, optimizer),
        "decision": None
        if decision is None
        else [decision.failure_kind.value, decision.mode.value, decision.step],
        "reason": None if decision is None else decision.reason,
    }
    (args.out / f"start-rank{rank}-attempt{attempt}.json").write_text(json.dumps(start))
    if attempt == 0:
        _faulty_ln_f(model, optimizer, rank, args.onset)
    boundaries: dict[int, list] = {}
    log = args.out / f"boundaries-rank{rank}-attempt{attempt}.json"
    for step in range(resiliency.start_step + 1, args.steps + 1):  # the plain loop
        loss_fn(ddp_model, next(loader)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % INTERVAL == 0:
            boundaries[step] = [state_digest(model, optimizer), None]
            log.write_text(json.dumps(boundaries))  # what a SIGKILL leaves behind
        # Pipelined: a boundary's verdict resolves in the next step's pre-step hook.
        last = resiliency.last_scout
        if last is not None and last.step in boundaries and boundaries[last.step][1] is None:
            boundaries[last.step][1] = [last.status.value, list(last.faulty_ranks)]
            log.write_text(json.dumps(boundaries))
    resiliency.close()  # resolves the last boundary's verdict
    last = resiliency.last_scout
    if last is not None and last.step in boundaries and boundaries[last.step][1] is None:
        boundaries[last.step][1] = [last.status.value, list(last.faulty_ranks)]
        log.write_text(json.dumps(boundaries))


if __name__ == "__main__":
    sys.exit(main(train))

"""``lm-resiliency demo``: a short multi-rank CPU training run that captures and recovers.

Each rank trains a small model with DDP on Gloo, GEMINI captures every
``--interval`` steps; at ``--fault-step`` every rank loses its live state (as a
restarted process would), the ranks agree on the newest common step, restore it
and train on. At the end the final parameters are compared bit for bit with a
fault-free run of the same seed and steps.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a short multi-rank CPU training run with recovery")
    p.add_argument("--world-size", type=int, default=4, help="number of ranks (default 4)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--interval", type=int, default=5, help="capture every N steps (default 5)")
    p.add_argument("--fault-step", type=int, default=18, help="step at which state is lost")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )


def _batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step * 1_009 + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _train(
    rank: int, world: int, steps: int, interval: int, fault_step: int, seed: int
) -> dict[str, Any]:
    model = nn.parallel.DistributedDataParallel(_model(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    events: list[str] = []
    recovery_s = 0.0
    with InMemoryCheckpointManager(InMemoryCkptConfig(interval=interval)) as manager:
        step = 1
        faulted = fault_step <= 0
        while step <= steps:
            x, y = _batch(seed, step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            manager.maybe_wait()
            opt.step()
            opt.zero_grad()
            if step % interval == 0:
                manager.save(
                    {"model": model.module.state_dict(), "optimizer": opt.state_dict()}, step
                )
            if not faulted and step == fault_step:
                faulted = True
                t0 = time.perf_counter()
                # Lose the live state, as a restarted worker would, and recover it.
                model = nn.parallel.DistributedDataParallel(_model(seed + 1))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                latest = manager.find_latest()
                if latest is None:
                    raise RuntimeError("no common GEMINI step to recover")
                state = manager.load(latest)
                model.module.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                recovery_s = time.perf_counter() - t0
                events.append(f"fault at step {step}: recovered step {latest} from own memory")
                step = latest + 1
                continue
            step += 1
        stats = manager.stats
        return {
            "digest": _digest(model.module),
            "events": events,
            "recovery_s": recovery_s,
            "captures": stats.captures,
            "save_ms": 1e3 * sum(stats.save_s) / max(1, len(stats.save_s)),
        }


def _fault_free(rank: int, world: int, steps: int, interval: int, seed: int) -> dict[str, Any]:
    return _train(rank, world, steps, interval, 0, seed)


def run(args: argparse.Namespace) -> int:
    print(
        f"lm-resiliency demo: {args.world_size} ranks, {args.steps} steps, "
        f"capture every {args.interval}, state lost at step {args.fault_step}"
    )
    t0 = time.perf_counter()
    faulty = run_distributed(
        _train,
        args.world_size,
        args=(args.steps, args.interval, args.fault_step, args.seed),
        timeout_s=300,
    )
    for rank, r in enumerate(faulty):
        for e in r["events"]:
            print(f"  rank {rank}: {e} in {r['recovery_s'] * 1e3:.1f} ms")
    print(
        f"  captures per rank: {faulty[0]['captures']}, mean save() blocking "
        f"{faulty[0]['save_ms']:.3f} ms"
    )
    reference = run_distributed(
        _fault_free, args.world_size, args=(args.steps, args.interval, args.seed), timeout_s=300
    )
    same = [a["digest"] == b["digest"] for a, b in zip(faulty, reference, strict=True)]
    print(
        f"  final parameters bit-identical to a fault-free run: {all(same)} "
        f"(digest {faulty[0]['digest']})"
    )
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0 if all(same) and dist.is_available() else 1

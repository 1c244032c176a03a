"""enable_resiliency on the training loop: steps/s of plain DDP vs DDP + enable_resiliency.

2 Gloo ranks train the demo's tiny GPT (DDP, AdamW, several buckets). In one
run, phases of ``--steps`` steps alternate (plain, enabled, plain, enabled, ...):
the plain phases are the same loop without a handle, the enabled ones run it
with ``enable_resiliency(ddp, optimizer, interval=10, state={"loader": loader})``
(construction and recovery excluded from the timing). Reported per rank:

* steps/s of each kind (median over phases) and the overhead ratio
  ``enabled_step_s / plain_step_s - 1`` (target <= 1% at interval 10; on a
  shared 2-core CPU host the phase-to-phase noise is of the same order, so
  the spread of the plain phases is printed next to it);
* the blocking time per capture seen by the training loop through the hooks:
  the post-step hook's launch plus the next pre-step hook's wait (median, max),
  and that time amortised over ``interval`` steps as a fraction of a step.

Prints a table and one JSON line. Not part of the test suite.
Usage: python benchmarks/integration.py [--steps 60] [--phases 4] [--interval 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT
from lm_resiliency.testing import run_distributed

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)


def _rank(rank: int, world: int, steps: int, phases: int, interval: int, folder: str) -> Any:
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(MODEL), bucket_cap_mb=0.1)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    loader = SyntheticTokens(0, 8, 32, MODEL.vocab_size, rank=rank, world_size=world)

    def train(n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            inputs, targets = next(loader)
            ddp(inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        return (time.perf_counter() - t0) / n

    train(10)  # warm-up: DDP's bucket rebuild, AdamW state allocation
    plain: list[float] = []
    enabled: list[float] = []
    launch: list[float] = []
    wait: list[float] = []
    for phase in range(phases):
        plain.append(train(steps))
        config = InMemoryCkptConfig(disk_folder=f"{folder}/{phase}", run_id=f"bench-{phase}")
        resiliency = enable_resiliency(
            ddp, optimizer, interval=interval, state={"loader": loader}, config=config
        )
        enabled.append(train(steps))
        launch += resiliency.stats.launch_s
        wait += resiliency.stats.wait_s
        resiliency.close()
    blocking = [a + b for a, b in zip(launch, wait, strict=False)]
    return {
        "plain_step_s": statistics.median(plain),
        "plain_spread": (max(plain) - min(plain)) / statistics.median(plain),
        "enabled_step_s": statistics.median(enabled),
        "captures": len(launch),
        "blocking_ms_median": 1e3 * statistics.median(blocking) if blocking else 0.0,
        "blocking_ms_max": 1e3 * max(blocking) if blocking else 0.0,
        "launch_ms_median": 1e3 * statistics.median(launch) if launch else 0.0,
        "wait_ms_median": 1e3 * statistics.median(wait) if wait else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--phases", type=int, default=4)
    p.add_argument("--interval", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmr-bench-integration-") as folder:
        results = run_distributed(
            _rank, 2, args=(a.steps, a.phases, a.interval, folder), timeout_s=1800
        )
    print(f"tiny GPT, 2 ranks, interval {a.interval}, {a.phases} x {a.steps} steps per kind")
    print(f"{'rank':>4} {'plain steps/s':>14} {'enabled steps/s':>16} {'overhead':>9} "
          f"{'plain spread':>13} {'block/capture ms':>17} {'amortised':>10}")  # fmt: skip
    out = []
    for rank, r in enumerate(results):
        overhead = r["enabled_step_s"] / r["plain_step_s"] - 1
        amortised = r["blocking_ms_median"] / 1e3 / a.interval / r["plain_step_s"]
        print(
            f"{rank:>4} {1 / r['plain_step_s']:>14.2f} {1 / r['enabled_step_s']:>16.2f} "
            f"{overhead:>+9.2%} {r['plain_spread']:>13.1%} "
            f"{r['blocking_ms_median']:>8.2f} (max {r['blocking_ms_max']:.1f}) {amortised:>10.3%}"
        )
        out.append({**r, "overhead": overhead, "amortised_blocking_fraction": amortised})
    print(json.dumps({"benchmark": "integration", "interval": a.interval, "ranks": out}))


if __name__ == "__main__":
    main()

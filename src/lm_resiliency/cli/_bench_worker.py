"""One rank of ``lm-resiliency bench``: the healthy-path scenarios, interleaved in one job.

Each rank trains the tiny GPT (DDP, AdamW, Gloo) through rounds. A round runs every
scenario once, in an order rotated per round so that no scenario always follows
another. A scenario phase builds its handle (construction, recovery and a warm-up
of ``interval`` steps are not timed), times ``steps`` steps between barriers, then
closes its handle:

* ``baseline``: the same loop without the package;
* ``gemini``: ``enable_resiliency`` with GEMINI captures every ``interval`` steps;
* ``scout``: SCOUT checks at that interval, GEMINI disabled (``enable=False``);
* ``combined``: GEMINI + SCOUT + MTGS (each step an MTGS transaction).

Per phase: the step time, and the time spent inside ``optimizer.step()`` (where the
package's hooks block the plain loop; the MTGS phase reports its whole step). The
test-only slowdown knob ``LM_RESILIENCY_BENCH_SLOWDOWN=<scenario>:<factor>`` makes
that scenario sleep ``factor`` times its step time after each timed step (the test
of a crossed threshold). The sleep is one duration agreed by every rank before the
timed steps (the slowest rank's median warm-up step): a sleep derived from each
rank's own last step would feed back, since a rank's step includes its wait for a
slower peer in the gradient all-reduce, and grow the gap between the ranks by the
factor at every step until the all-reduce times out.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection import ScoutConfig
from lm_resiliency.frontdoor import enable_resiliency
from lm_resiliency.frontdoor.handle import ResiliencyHandle
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT
from lm_resiliency.transactions.mtgs_config import MTGSConfig

__all__ = ["MODELS", "SCENARIOS", "SLOWDOWN_ENV", "run_rank"]

_phases = itertools.count()
SCENARIOS = ("baseline", "gemini", "scout", "combined")
SLOWDOWN_ENV = "LM_RESILIENCY_BENCH_SLOWDOWN"
MODELS = {
    # the demo's model (lm_resiliency.demo.training.MODEL)
    "demo": GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1),
    "larger": GPTConfig(
        vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=192, dropout=0.1
    ),
}


def slowdown(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, float] | None:
    """The test-only slowdown ``(scenario, factor)``, or None; ``ValueError`` when malformed."""
    raw = env.get(SLOWDOWN_ENV, "")
    if not raw:
        return None
    name, _, factor = raw.partition(":")
    if name not in SCENARIOS or not factor:
        raise ValueError(
            f"{SLOWDOWN_ENV}={raw!r}: expected <scenario>:<factor> with a scenario of "
            f"{list(SCENARIOS)}, e.g. gemini:9"
        )
    return name, float(factor)


def run_rank(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every phase of this rank, in the order run (``spec``: models, rounds, steps, interval)."""
    torch.set_num_threads(1)
    slow = slowdown()
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lmr-bench-") as folder:
        for model_name in spec["models"]:
            cfg = MODELS[model_name]
            torch.manual_seed(0)
            module = TinyGPT(cfg)
            optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4)
            loader = SyntheticTokens(
                0, 8, cfg.block_size, cfg.vocab_size, rank=rank, world_size=world
            )
            for rnd in range(spec["rounds"]):
                order = SCENARIOS[rnd % len(SCENARIOS) :] + SCENARIOS[: rnd % len(SCENARIOS)]
                for scenario in order:
                    factor = slow[1] if slow is not None and slow[0] == scenario else 0.0
                    # A fresh DDP wrapper per phase: MTGS registers its comm hook on it.
                    ddp = DDP(module, bucket_cap_mb=0.1)
                    phase = _phase(scenario, ddp, optimizer, loader, spec, folder, factor)
                    out.append({"model": model_name, "round": rnd, "scenario": scenario, **phase})
    return out


def _handle(
    scenario: str, ddp: DDP, optimizer: Any, loader: Any, interval: int, folder: str, run_id: str
) -> ResiliencyHandle | None:
    if scenario == "baseline":
        return None
    config = InMemoryCkptConfig(
        enable=scenario != "scout",
        interval=interval,
        disk_folder=folder,
        disk_flush_interval=0,
        memory_folder=None,
        signal_flush=False,
        flush_on_close=False,
        run_id=run_id,  # one per phase, the same on every rank: no phase resumes another
    )
    return enable_resiliency(
        ddp,
        optimizer,
        interval=interval,
        state={"loader": loader},
        config=config,
        scout=ScoutConfig() if scenario in ("scout", "combined") else None,
        mtgs=MTGSConfig() if scenario == "combined" else None,
    )


def _phase(
    scenario: str,
    ddp: DDP,
    optimizer: Any,
    loader: Any,
    spec: dict[str, Any],
    folder: str,
    factor: float,
) -> dict[str, Any]:
    interval, steps = int(spec["interval"]), int(spec["steps"])
    run_id = f"bench-{spec['job']}-{next(_phases)}"
    t_setup = time.perf_counter()
    handle = _handle(scenario, ddp, optimizer, loader, interval, folder, run_id)

    def step() -> float:
        """One training step; returns the time inside ``optimizer.step()`` (or the MTGS step)."""
        if handle is not None and handle.mtgs is not None:
            t0 = time.perf_counter()
            handle.train_step(lambda: ddp(*next(loader)))
            return time.perf_counter() - t0
        ddp(*next(loader)).backward()
        t0 = time.perf_counter()
        optimizer.step()
        spent = time.perf_counter() - t0
        optimizer.zero_grad(set_to_none=True)
        return spent

    try:
        warmup = []
        for _ in range(interval):  # warm-up: the first capture allocates its slots
            s0 = time.perf_counter()
            step()
            warmup.append(time.perf_counter() - s0)
        pause = factor * _agreed_step_s(warmup) if factor else 0.0
        captures_before = len(handle.stats.per_capture_s()) if handle is not None else 0
        dist.barrier()
        in_step = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            in_step += step()
            if pause:
                time.sleep(pause)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        blocking = handle.stats.per_capture_s()[captures_before:] if handle is not None else []
    finally:
        if handle is not None:
            handle.close()
    return {
        "setup_s": time.perf_counter() - t_setup - elapsed,  # enable, warm-up and close
        "steps": steps,
        "elapsed_s": elapsed,
        "step_s": elapsed / steps,
        "steps_per_s": steps / elapsed,
        "in_optimizer_step_s": in_step / steps,
        "blocking_per_capture_s": sorted(blocking)[len(blocking) // 2] if blocking else None,
        "captures": len(blocking),
    }


def _agreed_step_s(warmup: list[float]) -> float:
    """The slowest rank's median warm-up step time, the same on every rank (collective)."""
    median = torch.tensor([sorted(warmup)[len(warmup) // 2]], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())

"""MTGS: throughput overhead, collectives per step, and recovery time vs the memcpy limit.

In one run, on real Gloo ranks (CPU):

* tokens/s of the trainer's default model (tiny GPT, batch 8 x 64 tokens per
  rank) with 2 and 4 ranks: plain DDP vs MTGS with the shadow off (and no
  commit confirmation: the zero-extra-collective configuration) vs MTGS with
  the full protocol (shadow + two-phase commit). Modes run interleaved, in
  rounds, and the median step time of each mode is reported;
* collectives per healthy step, counted two ways: by torch.profiler
  (``c10d::`` collective ops in the trace) and by MTGS's own counters;
* ETTR of an abort decided before ``optimizer.step()`` (every step force-aborted
  once; median), and of a shadow rollback after a failed update (injected
  ``optimizer_exception``), compared with one flat ``copy_`` of the restored
  bytes into a pre-faulted buffer (the memcpy limit), on the default model and
  on a larger one where bandwidth, not per-tensor overhead, dominates.

Targets: 0 extra collectives per healthy step with the shadow off (1 with the
full protocol: the commit confirmation, see docs/mtgs.md), throughput within
3% of DDP with the shadow off, pre-step abort ETTR <= 1 ms median, rollback
<= 1.2x the memcpy time of the restored bytes.

Prints a table and one JSON line. Not part of the test suite.
Usage: python benchmarks/mtgs.py [--rounds 5] [--steps 8] [--world-sizes 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS, MTGSConfig

BATCH, SEQ = 8, 64
MODES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "mtgs_shadow_off": {"shadow": False, "two_phase_commit": False},
    "mtgs_shadow_on_no2pc": {"two_phase_commit": False},
    "mtgs_shadow_on": {},
}
LARGE = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=8, n_embd=512)
# The trainer's --model distilbert (DistilBertLM), narrowed so that 4 ranks fit a small
# machine: same module structure (embeddings, 6 blocks, tied vocabulary projector).
DISTILBERT = {"vocab_size": 8192, "n_layers": 6, "dim": 256, "hidden_dim": 1024, "n_heads": 4}
DISTILBERT_BATCH = 4
# MTGS's own methods timed per phase (wall clock, wrapped on the instance).
PHASES = {
    "shadow begin (caller)": ("shadow", "begin"),
    "forward+backward+hook": ("txn", "_micro_batch"),
    "vote read": ("txn", "_vote"),
    "shadow wait": ("shadow", "wait"),
    "optimizer+scheduler+finite check": ("txn", "_apply_update"),
    "commit confirmation": ("txn", "_exchange"),
    "zero grad": ("txn", "_zero_grad"),
}


def _model(kind: str) -> tuple[torch.nn.Module, int, int]:
    """The model, its vocabulary and the per-rank batch."""
    torch.manual_seed(0)
    if kind == "distilbert":
        from lm_resiliency.models.hf import DistilBertLM  # optional extra: imported when used

        config = dict(DISTILBERT)
        vocab = int(config.pop("vocab_size"))
        return DistilBertLM(vocab_size=vocab, **config), vocab, DISTILBERT_BATCH
    if kind == "gpt":
        return TinyGPT(GPTConfig()), GPTConfig().vocab_size, BATCH
    raise ValueError(f"model={kind!r}: use 'gpt' or 'distilbert'")


def _runner(
    rank: int,
    world: int,
    config: dict[str, Any] | None,
    kind: str,
    phases: dict[str, float],
    confirmations: list[float],
) -> Any:
    model, vocab, batch = _model(kind)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = synthetic_batches(1, batch, SEQ, vocab, rank=rank, world_size=world)

    def closure() -> torch.Tensor:
        x, y = next(data)
        loss: torch.Tensor = ddp(x, y)
        return loss

    if config is None:

        def step() -> None:
            closure().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, None
    txn = MTGS(ddp, opt, config=MTGSConfig(**config))
    owners = {"txn": txn, "shadow": txn.shadow}
    for phase, (owner, name) in PHASES.items():
        obj = owners[owner]
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, _timed(getattr(obj, name), phase, phases))
    exchange = txn._exchange

    def logged(*args: Any, **kwargs: Any) -> Any:  # every confirmation's own duration
        t0 = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            confirmations.append(time.perf_counter() - t0)

    txn._exchange = logged  # type: ignore[method-assign]
    return (lambda: txn.step(closure)), txn


def _timed(fn: Any, phase: str, into: dict[str, float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[phase] = into.get(phase, 0.0) + time.perf_counter() - t0

    return wrapper


def _collectives(step: Any, n: int) -> tuple[float, list[tuple[str, float]]]:
    """Collectives per step (profiler) and the top self-CPU ops (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # the profiler warns that it clears events per cycle
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
        names = Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        top = [(e.key, round(e.self_cpu_time_total / 1e3 / n, 3)) for e in ops]
    return sum(names.values()) / n, top


def bench_throughput(rank: int, world: int, rounds: int, steps: int, kind: str) -> dict[str, Any]:
    """Interleaved rounds of every mode; per-mode median and minimum of the round means.

    Each round runs every mode for ``steps`` steps, in a rotating order (so no mode
    always follows the same one), after a barrier. Wall clock and this process's CPU
    time (all its threads: compute, Gloo, the shadow worker) are both recorded.
    """
    phases: dict[str, dict[str, float]] = {name: {} for name in MODES}
    confirmations: list[float] = []
    runners = {
        name: _runner(rank, world, cfg, kind, phases[name], confirmations if cfg == {} else [])
        for name, cfg in MODES.items()
    }
    for step, _ in runners.values():
        for _ in range(3):  # warm-up: allocator, DDP's bucket rebuild, AdamW state
            step()
    for p in phases.values():
        p.clear()
    confirmations.clear()
    times: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    load = [os.getloadavg()[0]]
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = runners[name][0]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - t0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
        load.append(os.getloadavg()[0])
    # The confirmation's own cost: what the last rank to arrive waits in it (the others
    # also wait for the slowest rank's update, a skew DDP pays at its next all-reduce).
    every: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(every, confirmations)
    last_arrival = [min(per_rank) for per_rank in zip(*every, strict=True)]
    out: dict[str, Any] = {
        "load": load,
        "confirmation_last_arrival_ms": 1e3 * statistics.median(last_arrival),
        "confirmation_mean_ms": 1e3 * statistics.mean(confirmations),
    }
    tokens = (DISTILBERT_BATCH if kind == "distilbert" else BATCH) * SEQ
    for name, (step, txn) in runners.items():
        before = dict(txn.collectives) if txn is not None else {}
        per_step, top = _collectives(step, 2)
        own = 0.0
        if txn is not None:
            kinds = ("explicit_votes", "commit_confirmations")
            own = sum(txn.collectives[k] - before[k] for k in kinds) / 2
            txn.close()
        out[name] = {
            "step_s": statistics.median(times[name]),
            "step_min_s": min(times[name]),
            "cpu_s": statistics.median(cpu[name]),
            "cpu_min_s": min(cpu[name]),
            "round_s": times[name],
            "tokens_per_s": world * tokens / statistics.median(times[name]),
            "vs_ddp_paired": statistics.median(
                d / t for d, t in zip(times["ddp"], times[name], strict=True)
            ),
            "collectives_per_step": per_step,
            "mtgs_own_collectives_per_step": own,
            "phases_ms": {k: 1e3 * v / (rounds * steps) for k, v in phases[name].items()},
            "top_ops_ms": top,
        }
    return out


def bench_recovery(rank: int, world: int, steps: int, large: bool) -> dict[str, Any]:
    """ETTR of pre-step aborts (default model) and shadow rollbacks vs memcpy."""
    out: dict[str, Any] = {}
    gpts = {"default": GPTConfig(), **({"large": LARGE} if large else {})}
    for label, gpt in gpts.items():
        torch.manual_seed(0)
        model = TinyGPT(gpt)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = synthetic_batches(1, BATCH, SEQ, gpt.vocab_size, rank=rank, world_size=world)
        # steps 2..: alternately a forced pre-step abort and a failed update (rollback)
        forced = {s for s in range(2, steps + 2) if s % 2 == 0} if label == "default" else set()
        broken = [s for s in range(2, steps + 2) if s not in forced]
        faults = FaultInjector(",".join(f"optimizer_exception@0:{s}" for s in broken), rank=rank)
        faults.arm()
        faults.install(model, opt)
        txn = MTGS(
            ddp, opt, config=MTGSConfig(force_abort_steps=forced), data_state=data, faults=faults
        )

        def closure(ddp: DDP = ddp, data: Any = data) -> torch.Tensor:
            x, y = next(data)
            loss: torch.Tensor = ddp(x, y)
            return loss

        assert txn.shadow is not None
        nbytes = 0
        memcpy = []
        for _ in range(steps + 1):
            txn.step(closure)
            if txn.shadow.nbytes != nbytes:  # step 2 on: the optimizer state exists
                nbytes = txn.shadow.nbytes
                src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
                dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
                memcpy.clear()
            # interleaved with the rollbacks, so both see the same machine load
            t0 = time.perf_counter_ns()
            dst.copy_(src)
            memcpy.append(time.perf_counter_ns() - t0)
        out[label] = {
            "params": model.num_parameters(),
            "restored_bytes": nbytes,
            "abort_ettr_ns": txn.ettr.durations_ns("abort"),
            "rollback_ettr_ns": txn.ettr.durations_ns("rollback"),
            "memcpy_ns": statistics.median(memcpy),
            "memcpy_min_ns": min(memcpy),
        }
        txn.close()
    return out


def _med(values: list[int]) -> float:
    return statistics.median(values) if values else float("nan")


def _print_throughput(throughput: dict[str, dict[int, Any]]) -> None:
    head = ("model", "ranks", "mode", "step ms", "min ms", "vs ddp", "paired", "cpu", "cpu min")
    print(
        "{:<10} {:>5} {:<21} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7} {:>5} {:>4}".format(
            *head, "coll", "own"
        )
    )
    for kind, worlds in throughput.items():
        for world, modes in worlds.items():
            base = modes["ddp"]
            for name in MODES:
                m = modes[name]
                row = (
                    kind,
                    world,
                    name,
                    m["step_s"] * 1e3,
                    m["step_min_s"] * 1e3,
                    base["step_s"] / m["step_s"],
                    m["vs_ddp_paired"],
                    base["cpu_s"] / m["cpu_s"],
                    base["cpu_min_s"] / m["cpu_min_s"],
                    m["collectives_per_step"],
                    m["mtgs_own_collectives_per_step"],
                )
                print(
                    "{:<10} {:>5} {:<21} {:>8.2f} {:>8.2f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} "
                    "{:>5.1f} {:>4.1f}".format(*row)
                )
            step_on = modes["mtgs_shadow_on"]["step_s"] * 1e3
            last = modes["confirmation_last_arrival_ms"]
            print(
                f"{'':<10} {'':>5} commit confirmation: {last:.3f} ms for the last rank to "
                f"arrive ({100 * last / step_on:.2f}% of the step), "
                f"{modes['confirmation_mean_ms']:.3f} ms mean over ranks (incl. waiting for peers)"
            )
            load = ", ".join(f"{x:.1f}" for x in modes["load"])
            print(f"{'':<10} {'':>5} load average (1 min) per round: {load}")
            on = modes["mtgs_shadow_on"]["phases_ms"]
            step_ms = modes["mtgs_shadow_on"]["step_s"] * 1e3
            parts = ", ".join(f"{k} {v:.3f}" for k, v in on.items())
            print(f"{'':<10} {'':>5} shadow-on phases, ms/step of {step_ms:.1f}: {parts}")
            for name in ("ddp", "mtgs_shadow_off"):
                top = ", ".join(f"{k} {v:.2f}" for k, v in modes[name]["top_ops_ms"][:5])
                print(f"{'':<10} {'':>5} top self-CPU ops {name} (ms/step): {top}")
    print()


def _throughput_summary(throughput: dict[str, dict[int, Any]]) -> dict[str, Any]:
    """Ratios vs plain DDP (paired per round, median), collectives and the targets."""
    ratios = {
        kind: {
            w: {n: round(m[n]["vs_ddp_paired"], 4) for n in MODES if n != "ddp"}
            for w, m in worlds.items()
        }
        for kind, worlds in throughput.items()
    }
    cpu_ratios = {
        kind: {
            w: {n: round(m["ddp"]["cpu_min_s"] / m[n]["cpu_min_s"], 4) for n in MODES if n != "ddp"}
            for w, m in worlds.items()
        }
        for kind, worlds in throughput.items()
    }
    extra = {
        kind: {
            w: {
                n: m[n]["collectives_per_step"] - m["ddp"]["collectives_per_step"]
                for n in MODES
                if n != "ddp"
            }
            for w, m in worlds.items()
        }
        for kind, worlds in throughput.items()
    }
    confirm_share = {
        kind: {
            w: round(m["confirmation_last_arrival_ms"] / (1e3 * m["mtgs_shadow_on"]["step_s"]), 4)
            for w, m in worlds.items()
        }
        for kind, worlds in throughput.items()
    }
    flat = [r for worlds in ratios.values() for modes in worlds.values() for r in modes.items()]
    off = min(v for n, v in flat if n == "mtgs_shadow_off")
    on = min(v for n, v in flat if n == "mtgs_shadow_on")
    every = [e for worlds in extra.values() for e in worlds.values()]
    return {
        "throughput_vs_ddp": ratios,
        "cpu_time_vs_ddp_min": cpu_ratios,
        "throughput_vs_ddp_shadow_off": off,
        "throughput_vs_ddp_shadow_on": on,
        "extra_collectives_per_step": extra,
        "confirmation_share_of_step": confirm_share,
        "load_avg_per_round": {
            kind: {w: m["load"] for w, m in worlds.items()} for kind, worlds in throughput.items()
        },
        "targets_met": {
            "zero_extra_collectives_shadow_off": all(e["mtgs_shadow_off"] == 0 for e in every),
            "one_extra_collective_full_protocol": all(e["mtgs_shadow_on"] == 1 for e in every),
            "throughput_within_3pct_shadow_off": off >= 0.97,
            "throughput_within_3pct_shadow_on": on >= 0.97,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="steps per round and mode")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--models", nargs="+", default=["gpt", "distilbert"])
    ap.add_argument("--distilbert-steps", type=int, default=3, help="steps per round (slow model)")
    ap.add_argument("--recovery-steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="skip the large-model rollback")
    ap.add_argument("--no-recovery", action="store_true", help="throughput only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    throughput: dict[str, dict[int, Any]] = {}
    for kind in args.models:
        throughput[kind] = {}
        for world in args.world_sizes:
            steps = args.distilbert_steps if kind == "distilbert" else args.steps
            res = run_distributed(
                bench_throughput,
                world,
                args=(args.rounds, steps, kind),
                timeout_s=3600,
                threads_per_rank=args.threads,
            )
            throughput[kind][world] = res[0]
    _print_throughput(throughput)
    if args.no_recovery:
        print(json.dumps({"bench": "mtgs", **_throughput_summary(throughput)}))
        return
    rec = run_distributed(
        bench_recovery,
        2,
        args=(args.recovery_steps, not args.quick),
        timeout_s=1800,
        threads_per_rank=args.threads,
    )[0]

    print()
    head = ("model", "restored", "abort ETTR", "rollback", "memcpy", "ratio", "min/min")
    print("{:<8} {:>10} {:>11} {:>10} {:>9} {:>6} {:>8}".format(*head))
    for label, r in rec.items():
        roll, abort, copy = _med(r["rollback_ettr_ns"]), _med(r["abort_ettr_ns"]), r["memcpy_ns"]
        shown = f"{abort / 1e6:>9.3f}ms" if r["abort_ettr_ns"] else f"{'-':>11}"
        low = min(r["rollback_ettr_ns"]) / r["memcpy_min_ns"]
        row = (label, r["restored_bytes"] / 2**20, shown, roll / 1e6, copy / 1e6, roll / copy, low)
        print("{:<8} {:>8.1f}MB {} {:>8.3f}ms {:>7.3f}ms {:>6.2f} {:>8.2f}".format(*row))
    print(f"load average (1 min): {os.getloadavg()[0]:.1f}")

    abort_ms = _med(rec["default"]["abort_ettr_ns"]) / 1e6
    rollback_ratio = {
        label: _med(r["rollback_ettr_ns"]) / r["memcpy_ns"] for label, r in rec.items()
    }
    rollback_min_ratio = {
        label: min(r["rollback_ettr_ns"]) / r["memcpy_min_ns"] for label, r in rec.items()
    }
    best_rollback = rollback_ratio.get("large", rollback_ratio["default"])
    summary = {
        "bench": "mtgs",
        **_throughput_summary(throughput),
        "pre_step_abort_ettr_median_ms": round(abort_ms, 4),
        "rollback_ettr_median_ms": {
            label: round(_med(r["rollback_ettr_ns"]) / 1e6, 4) for label, r in rec.items()
        },
        "rollback_restored_mb": {k: round(r["restored_bytes"] / 2**20, 1) for k, r in rec.items()},
        "memcpy_ms": {label: round(r["memcpy_ns"] / 1e6, 4) for label, r in rec.items()},
        "rollback_vs_memcpy": {k: round(v, 3) for k, v in rollback_ratio.items()},
        "rollback_vs_memcpy_min_over_min": {k: round(v, 3) for k, v in rollback_min_ratio.items()},
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    summary["targets_met"].update(
        pre_step_abort_ettr_le_1ms=abort_ms <= 1.0, rollback_le_1_2x_memcpy=best_rollback <= 1.2
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""SCOUT: overhead on the demo model with DDP, time and bytes per check, detection latency.

In one run, on real Gloo ranks (CPU):

* the demo's trainer (tiny GPT, DDP, AdamW; ``lm_resiliency.demo.training``) runs
  rounds that alternate a phase without SCOUT and a phase with SCOUT checking at
  interval 10 (the recording hooks paused / active, a check every 10th step);
  the median step time of each mode is reported with its ratio;
* the accounted overhead, as the contract measures it: the time SCOUT blocks the
  training (each check, plus the recording hooks' cost per step) amortized over
  the interval, as a share of the plain step time. Target: <= 1 %;
* time per check (median, p90), bytes exchanged per check, re-runs;
* detection latency: a persistent SDC is injected on rank 1 into a random block
  from a random step; the number of steps until a check reports it (the rotation
  bounds it by interval x number of blocks).

Prints a table and one JSON line. Not part of the test suite.
Usage: python benchmarks/scout.py [--world 2] [--rounds 4] [--steps 40] [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from lm_resiliency.demo.training import Trainer
from lm_resiliency.detection import Scout, ScoutConfig, ScoutStatus
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.testing import run_distributed

INTERVAL = 10


def _paused(scout: Scout, paused: bool) -> None:
    for r in scout.executor.recorders:
        r.paused = paused


def _overhead(rank: int, world: int, rounds: int, steps: int) -> dict[str, Any]:
    trainer = Trainer(0, rank=rank, world_size=world)
    scout = Scout(ScoutConfig(interval=INTERVAL), trainer.ddp)
    times: dict[str, list[float]] = {"off": [], "on": []}
    checks: list[float] = []
    bytes_per_check: list[int] = []
    reruns = 0
    statuses: list[str] = []
    step = 0
    for _ in range(3):  # warm-up: DDP's bucket rebuild, allocator, first replays
        step += 1
        trainer.forward_backward()
        trainer.optimizer_step()
        scout.check(step)
    for _ in range(rounds):
        for mode in ("off", "on"):
            _paused(scout, mode == "off")
            for _ in range(steps):
                step += 1
                t0 = time.perf_counter()
                trainer.forward_backward()
                trainer.optimizer_step()
                if mode == "on" and step % INTERVAL == 0:
                    c0 = time.perf_counter()
                    r = scout.check(step)
                    checks.append(time.perf_counter() - c0)
                    bytes_per_check.append(r.bytes_exchanged)
                    reruns += r.rerun
                    statuses.append(r.status.value)
                times[mode].append(time.perf_counter() - t0)
    _paused(scout, False)
    hook = _hook_cost(trainer, scout)
    scout.close()
    return {
        "times": times,
        "checks": checks,
        "bytes": bytes_per_check,
        "reruns": reruns,
        "statuses": statuses,
        "hook_s": hook,
        "blocks": len(scout.blocks),
    }


def _hook_cost(trainer: Trainer, scout: Scout) -> float:
    """Seconds the recording hooks add to one forward (recorded minus paused), local."""
    model = trainer.ddp.module
    inputs, _ = next(trainer._stream())
    samples: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        for i in range(60):
            paused = i % 2 == 0
            _paused(scout, paused)
            t0 = time.perf_counter()
            model(inputs)
            samples[paused].append(time.perf_counter() - t0)
    _paused(scout, False)
    return max(0.0, statistics.median(samples[False]) - statistics.median(samples[True]))


def _latency(rank: int, world: int, trials: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for trial in range(trials):
        trainer = Trainer(trial, rank=rank, world_size=world)
        scout = Scout(ScoutConfig(interval=INTERVAL), trainer.ddp)
        block = rng.randrange(len(scout.blocks))
        onset = rng.randrange(5, 60)
        faults = ComputeFaults(
            [PersistentSDC(rank=1, module=scout.blocks[block].module, from_step=onset)],
            rank=rank,
        )
        faults.arm()
        faults.install(trainer.optimizer)
        found = None
        for step in range(1, onset + INTERVAL * (len(scout.blocks) + 1) + 1):
            trainer.forward_backward()
            trainer.optimizer_step()
            if step % INTERVAL == 0:
                r = scout.check(step)
                if r.status in (ScoutStatus.SDC, ScoutStatus.INCONCLUSIVE):
                    found = (step, r.status.value, r.faulty_ranks)
                    break
        faults.remove()
        scout.close()
        out.append(
            {
                "block": scout.blocks[block].label,
                "onset": onset,
                "detected": found[0] if found else None,
                "status": found[1] if found else None,
                "faulty": list(found[2]) if found else None,
                "latency": (found[0] - onset) if found else None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="steps per phase (a multiple of 10)")
    ap.add_argument("--trials", type=int, default=6, help="detection-latency trials")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 20 steps, 3 trials")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.trials = 2, 20, 3
    res = run_distributed(
        _overhead, args.world, args=(args.rounds, args.steps), timeout_s=1800, pg_timeout_s=600
    )
    r0 = res[0]
    off = statistics.median(r0["times"]["off"])
    on_steps = r0["times"]["on"]
    on = statistics.median(on_steps)
    mean_off = statistics.fmean(r0["times"]["off"])
    mean_on = statistics.fmean(on_steps)
    # The slowest rank's check time is what every rank waits for.
    checks = [max(r["checks"][i] for r in res) for i in range(len(r0["checks"]))]
    check_med = statistics.median(checks)
    check_p90 = sorted(checks)[int(0.9 * (len(checks) - 1))]
    hook = max(r["hook_s"] for r in res)
    accounted = (statistics.fmean(checks) / INTERVAL + hook) / off
    lat = run_distributed(
        _latency, max(3, args.world), args=(args.trials, 7), timeout_s=1800, pg_timeout_s=600
    )[0]
    latencies = [t["latency"] for t in lat if t["latency"] is not None]
    summary = {
        "world": args.world,
        "interval": INTERVAL,
        "blocks": r0["blocks"],
        "step_s_off_median": off,
        "step_s_on_median": on,
        "end_to_end_ratio_median": on / off,
        "end_to_end_ratio_mean": mean_on / mean_off,
        "check_s_median": check_med,
        "check_s_p90": check_p90,
        "hook_s_per_forward": hook,
        "accounted_overhead": accounted,
        "target_overhead": 0.01,
        "bytes_per_check_median": statistics.median(r0["bytes"]),
        "reruns": r0["reruns"],
        "statuses": sorted(set(r0["statuses"])),
        "detection": lat,
        "latency_steps_mean": statistics.fmean(latencies) if latencies else None,
        "latency_steps_max": max(latencies) if latencies else None,
        "detected": f"{len(latencies)}/{len(lat)}",
        "latency_bound_steps": INTERVAL * r0["blocks"],
    }
    print(f"SCOUT on the demo GPT, DDP x{args.world} (CPU, Gloo), check interval {INTERVAL}")
    print(
        f"  step time without / with SCOUT (median): {off * 1e3:.2f} / {on * 1e3:.2f} ms"
        f"  (ratio {on / off:.3f}; mean ratio {mean_on / mean_off:.3f})"
    )
    print(
        f"  time per check: median {check_med * 1e3:.2f} ms, p90 {check_p90 * 1e3:.2f} ms;"
        f" recording hooks {hook * 1e6:.0f} us per forward"
    )
    print(f"  accounted overhead: {accounted * 100:.2f} % of step time (target <= 1 %)")
    print(
        f"  bytes exchanged per check: {summary['bytes_per_check_median']:.0f}"
        f"; re-runs: {r0['reruns']}; statuses: {summary['statuses']}"
    )
    print(
        f"  detection latency (steps after onset): {latencies} "
        f"(bound {summary['latency_bound_steps']}), detected {summary['detected']}"
    )
    for t in lat:
        print(
            f"    SDC in {t['block']:<10} from step {t['onset']:>3}: "
            f"detected at {t['detected']} ({t['status']}, ranks {t['faulty']})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

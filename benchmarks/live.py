"""Live membership on the demo model, 4 replica groups (docs/live-membership.md §8, §10).

    PYTHONPATH=src python benchmarks/live.py [--steps 200] [--step-sleep-s 0] [--pairs 3]

1. One run of ``lm-resiliency demo --live``'s job (replica 1 SIGKILLed in the forward of step
   8): kill -> first committed step of the survivors, split into detection, agreement, group
   rebuild and step redo (the redo's commit record carries the adopted change's timings);
   kill -> full world again and the heal when the heal is built. The same run again with one
   warm spare (``launch --warm-spares 1``): kill -> full world again when a pre-started process
   takes the replica's place instead of its torchrun's restart, split into the takeover (the
   coordinator's assignment), the spare's registration as the joiner, and the heal.
2. Healthy-path steps/s, live membership on (4 replica groups under the launcher, the rate
   from replica 0's commit times) vs off (the same 4 processes as one plain torchrun DDP +
   MTGS job), interleaved ``--pairs`` times; the ratio of the medians. The rate moves a few
   percent between runs of either mode on a host whose cores the 4 workers saturate, so each
   pair also runs both modes for ``--short-steps`` steps and reports the CPU time per step of
   the whole process tree (launcher, coordinator, torchrun agents, workers; ``getrusage`` of
   the waited-for children) as the difference between the long and the short run, which
   leaves out start-up and shutdown: live membership's cost per step in CPU.
3. The heal transfer rate (``benchmarks/live_heal.py``'s measurement, ``--heal-mib`` MiB,
   2 ranks): the heal vs raw Gloo send/recv of the same bytes, and vs the same receive into
   fresh memory (what a joiner has).

Prints the targets next to the measurements with the machine's load average, then one JSON
line. A measurement under load is a measurement of that load: read the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from lm_resiliency.cli.demo_live import heal_available
from lm_resiliency.demo.live_launch import LiveSpec, follow, start
from lm_resiliency.demo.live_timeline import KillTimeline, kill_timeline
from lm_resiliency.demo.live_worker import SAMPLES
from lm_resiliency.live.runcheck import LiveRun, check_run, read_events
from lm_resiliency.testing.torchrun import start_torchrun

sys.path.insert(0, str(Path(__file__).parent))
from live_heal import measure as measure_heal  # the benchmark beside this one

_OFF = str(Path(__file__).with_name("_live_off_worker.py"))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _on_rate(steps: int, warmup: int, work: Path) -> float:
    # No stand-in compute (the kill run's step_sleep_s): the "off" job has none either, and
    # the bare demo step (a few ms) is where a per-step cost shows most.
    spec = LiveSpec(steps=steps, kill_replicas=(), digest_every=0, step_sleep_s=0.0)
    job = start(spec, work)
    problem = follow(job, 600)
    if problem is not None:
        raise SystemExit(f"live run failed: {problem}\n{job.log_tail()}")
    ts = {
        r["step"]: r["ts_ns"] / 1e9
        for r in read_events(work)
        if r["event"] == "mtgs.commit" and r["replica"] == 0
    }
    return float((steps - warmup) / (ts[steps] - ts[warmup]))


def _off_rate(steps: int, warmup: int, work: Path) -> float:
    out = work / "off.json"
    job = start_torchrun(
        [_OFF, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)],
        4,
        workdir=work / "torchrun",
    )
    done = job.wait(600)
    if done.returncode != 0:
        raise SystemExit(f"off run failed:\n{done.brief()}")
    return float(json.loads(out.read_text())["steps_per_s"])


def _kill_run(spec: LiveSpec, work: Path, heal: bool) -> tuple[LiveRun, KillTimeline]:
    job = start(spec, work)
    problem = follow(job, 600, heal_wait_s=30.0 if heal else 0.0)
    if problem is not None:
        raise SystemExit(f"kill run failed: {problem}\n{job.log_tail()}")
    run = check_run(work, stream=(spec.seed, SAMPLES, spec.global_batch))
    return run, kill_timeline(work, run, spec.kill_replicas[0], spec.kill_step)


def _spare_split(work: Path, killed: int) -> dict[str, float | None]:
    """The spare path after the kill: assigned, registered (``live.joining``), healed."""
    t_kill = float((work / f"kill-{killed}").read_text())
    recs = [r for r in read_events(work) if r["replica"] == killed]
    take = next((r for r in recs if r["event"] == "live.takeover"), None)
    if take is None:
        return {"assigned": None, "registered": None, "healed": None}
    pid = take["pid"]
    joined = next(r for r in recs if r["pid"] == pid and r["event"] == "live.joining")
    healed = next((r for r in recs if r["pid"] == pid and r["event"] == "live.healed"), None)
    return {
        "assigned": take["assigned_t"] - t_kill,
        "registered": joined["ts_ns"] / 1e9 - t_kill,
        "healed": None if healed is None else healed["ts_ns"] / 1e9 - t_kill,
    }


def _children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _timed(fn, steps: int, warmup: int, work: Path) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(steps/s, CPU seconds of the job's whole process tree)."""
    cpu0 = _children_cpu_s()
    rate = fn(steps, warmup, work)
    return rate, _children_cpu_s() - cpu0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The kill run: the bare demo step (no stand-in compute, unlike the demo's 0.3 s, which
    # would be counted in the agreement and the redo), and enough steps that the restarted
    # replica is healed and the world is full again before the survivors finish.
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--healthy-steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--short-steps", type=int, default=100)
    p.add_argument("--heal-mib", type=int, default=64)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lmr-bench-live-"))
    result: dict[str, object] = {"load_before": _load()}
    try:
        kill_dir = root / "kill"
        kill_dir.mkdir()
        spec = LiveSpec(steps=args.steps, step_sleep_s=args.step_sleep_s)
        heal = heal_available()
        _, tl = _kill_run(spec, kill_dir, heal)
        spare_dir = root / "spare"
        spare_dir.mkdir()
        spare_spec = dataclasses.replace(spec, warm_spares=1)
        _, tl_spare = _kill_run(spare_spec, spare_dir, heal)
        split = _spare_split(spare_dir, spec.kill_replicas[0])
        load_kill = _load()
        on: list[float] = []
        off: list[float] = []
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        long_n, short_n = args.healthy_steps, args.short_steps
        for i in range(args.pairs):
            for mode, rates, fn in (("on", on, _on_rate), ("off", off, _off_rate)):
                d = root / f"{mode}-{i}"
                d.mkdir()
                rate, cpu_long = _timed(fn, long_n, args.warmup, d)
                rates.append(rate)
                (d / "short").mkdir()
                _, cpu_short = _timed(fn, short_n, args.warmup, d / "short")
                cpu[mode].append((cpu_long - cpu_short) / (long_n - short_n))
        load_healthy = _load()
        (heal_row,) = measure_heal([args.heal_mib], 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cost = 1.0 - statistics.median(on) / statistics.median(off)
    print(f"kill -> first committed step of the survivors: {tl.first_commit_s:.3f} s   "
          f"(target <= 1 s, stretch <= 0.3 s; load {load_kill})")  # fmt: skip
    for name, value in tl.phases().items():
        print(f"  {name:<14} " + ("n/a" if value is None else f"{value:7.3f} s"))
    if heal:
        full = "not reached" if tl.full_world_s is None else f"{tl.full_world_s:.3f} s"
        print(f"kill -> full world again: {full} (its torchrun restarts the replica)")
        full_s = (
            "not reached" if tl_spare.full_world_s is None else f"{tl_spare.full_world_s:.3f} s"
        )
        print(f"kill -> full world again, one warm spare: {full_s}   (first commit "
              f"{tl_spare.first_commit_s:.3f} s)")  # fmt: skip
        for name, value in split.items():
            print(
                f"  spare {name:<10} "
                + ("n/a" if value is None else f"{value:7.3f} s after the kill")
            )
        if tl.full_world_s and tl_spare.full_world_s:
            speedup = tl.full_world_s / tl_spare.full_world_s
            print(f"  the spare is {speedup:.1f}x faster to a full world")
    else:
        print("kill -> full world again: not measured (heal not merged)")
        print("heal transfer rate: not measured (heal not merged)")
    print(f"healthy path steps/s, live on:  {', '.join(f'{r:.3f}' for r in on)}")
    print(f"healthy path steps/s, live off: {', '.join(f'{r:.3f}' for r in off)}")
    ratio = statistics.median(on) / statistics.median(off)
    print(
        f"live membership cost: {cost:+.1%} of steps/s (target <= 2%; on/off = {ratio:.3f}; "
        f"load {load_healthy})"
    )
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    print(f"CPU per step, whole process tree, live on:  "
          f"{', '.join(f'{1e3 * c:.1f}' for c in cpu['on'])} ms")  # fmt: skip
    print(f"CPU per step, whole process tree, live off: "
          f"{', '.join(f'{1e3 * c:.1f}' for c in cpu['off'])} ms")  # fmt: skip
    cpu_cost = cpu_on / cpu_off - 1.0
    print(f"live membership cost in CPU per step: {cpu_cost:+.1%} (target <= 2%; medians "
          f"{1e3 * cpu_on:.1f} vs {1e3 * cpu_off:.1f} ms, runs of {long_n} minus {short_n} "
          "steps)")  # fmt: skip
    print(f"heal transfer, {args.heal_mib} MiB: {heal_row['heal_gbps']:.2f} GB/s = "
          f"{heal_row['ratio']:.2f}x raw Gloo send/recv ({heal_row['raw_gbps']:.2f} GB/s; target "
          f">= 0.8x), {heal_row['ratio_fresh']:.2f}x the same receive into fresh memory "
          f"({heal_row['raw_fresh_gbps']:.2f} GB/s)")  # fmt: skip
    result.update(
        heal_transfer=heal_row,
        first_commit_s=tl.first_commit_s,
        phases_s=tl.phases(),
        full_world_s=tl.full_world_s,
        spare_full_world_s=tl_spare.full_world_s,
        spare_first_commit_s=tl_spare.first_commit_s,
        spare_split_s=split,
        heal="measured" if heal else "not measured (heal not merged)",
        on_steps_per_s=on,
        off_steps_per_s=off,
        cost=cost,
        cpu_per_step_on_s=cpu["on"],
        cpu_per_step_off_s=cpu["off"],
        cpu_cost=cpu_cost,
        load_kill=load_kill,
        load_healthy=load_healthy,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

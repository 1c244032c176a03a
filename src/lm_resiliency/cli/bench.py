"""``lm-resiliency bench``: the healthy-path benchmark, with thresholds that fail the run.

The scenarios (baseline: the package disabled; GEMINI; SCOUT; GEMINI + SCOUT + MTGS)
run interleaved in one job of real Gloo ranks, on the demo model and on a larger
one (``cli/_bench_worker.py``). Per model and scenario, over the rounds (medians):

* ``steps_per_s``;
* ``step_time_ratio``: the scenario's step time over the baseline's of the same round;
* ``blocking_per_capture_s``: the hooks' launch plus wait of each capture (GEMINI);
* ``accounted_overhead``: the time inside ``optimizer.step()``, where the package's
  hooks block the plain loop, in excess of the baseline's, as a share of the
  baseline's step (the MTGS scenario: its whole step in excess of the baseline step).

The thresholds are ratios only, never absolute times, per scenario, in a checked-in
file (``bench_thresholds.json`` beside this module, ``--thresholds`` to use another):
its ``"full"`` section for scheduled runs and ``"quick"`` (generous) for the CI smoke
``--quick``. A crossed threshold is printed with its scenario, model, value and
limit, and the command exits with status 1. Every run appends one JSON line per
phase and one summary line to ``--results``; ``--plot`` draws steps/s per scenario
over the run (the ``plot`` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lm_resiliency.cli._bench_worker import MODELS, SCENARIOS, run_rank, slowdown
from lm_resiliency.testing import run_distributed

__all__ = ["check_thresholds", "load_thresholds", "register", "run", "summarize"]

THRESHOLDS = Path(__file__).with_name("bench_thresholds.json")
_LIMITS = {"max_step_time_ratio": "step_time_ratio", "max_accounted_overhead": "accounted_overhead"}
_FULL = {"rounds": 4, "steps": 40, "interval": 10, "models": ["demo", "larger"]}
_QUICK = {"rounds": 2, "steps": 10, "interval": 5, "models": ["demo"]}


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to the ``lm-resiliency`` parser."""
    p = subparsers.add_parser(
        "bench",
        help="healthy-path benchmark: baseline, GEMINI, SCOUT, combined, with thresholds",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--quick", action="store_true", help="the CI smoke: short, generous limits")
    p.add_argument("--world", type=int, default=2, help="Gloo ranks on this host (default 2)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: demo larger")
    p.add_argument("--rounds", type=int, help="rounds of every scenario (full: 4, quick: 2)")
    p.add_argument("--steps", type=int, help="timed steps per phase (full: 40, quick: 10)")
    p.add_argument("--interval", type=int, help="capture/check interval (full: 10, quick: 5)")
    p.add_argument("--thresholds", type=Path, default=THRESHOLDS, help="thresholds JSON file")
    p.add_argument(
        "--results", type=Path, default=Path("bench-results.jsonl"), help="JSON lines appended"
    )
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="draw steps/s per scenario (matplotlib)"
    )
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound of the whole job")
    p.set_defaults(func=run)


def load_thresholds(path: Path, section: str) -> dict[str, dict[str, float]]:
    """The ``section`` of a thresholds file; ``ValueError`` naming what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"thresholds file {path}: {exc}") from exc
    limits = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(limits, dict):
        raise ValueError(f"thresholds file {path} has no {section!r} section")
    for scenario, entry in limits.items():
        if scenario not in SCENARIOS[1:] or not isinstance(entry, dict):
            raise ValueError(
                f"thresholds file {path}: {section}.{scenario} is not a scenario of "
                f"{list(SCENARIOS[1:])} with limits"
            )
        for key, value in entry.items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if key not in _LIMITS or not ok:
                raise ValueError(
                    f"thresholds file {path}: {section}.{scenario}.{key}={value!r}; limits are "
                    f"ratios > 0 named {sorted(_LIMITS)} (never absolute times)"
                )
    return limits


def summarize(phases: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per model and scenario, the medians over rounds (see the module doc)."""
    base = {(p["model"], p["round"]): p for p in phases if p["scenario"] == "baseline"}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for model in dict.fromkeys(p["model"] for p in phases):
        out[model] = {}
        for scenario in SCENARIOS:
            mine = [p for p in phases if p["model"] == model and p["scenario"] == scenario]
            ratio, accounted = [], []
            for p in mine:
                b = base[(model, p["round"])]
                ratio.append(p["step_s"] / b["step_s"])
                if scenario == "combined":  # MTGS: its whole step is the package's
                    excess = p["in_optimizer_step_s"] - b["step_s"]
                else:
                    excess = p["in_optimizer_step_s"] - b["in_optimizer_step_s"]
                accounted.append(excess / b["step_s"])
            blocking = [p["blocking_per_capture_s"] for p in mine if p["blocking_per_capture_s"]]
            out[model][scenario] = {
                "steps_per_s": statistics.median(p["steps_per_s"] for p in mine),
                "step_time_ratio": statistics.median(ratio),
                "accounted_overhead": statistics.median(accounted),
                "blocking_per_capture_s": statistics.median(blocking) if blocking else None,
            }
    return out


def check_thresholds(
    summary: dict[str, dict[str, dict[str, float | None]]], limits: dict[str, dict[str, float]]
) -> list[str]:
    """One line per crossed threshold (empty: every scenario within its limits)."""
    crossed = []
    for model, scenarios in summary.items():
        for scenario, entry in limits.items():
            for key, limit in entry.items():
                value = scenarios[scenario][_LIMITS[key]]
                if value is not None and value > limit:
                    crossed.append(
                        f"{scenario} on the {model} model: {_LIMITS[key]}={value:.3f} crosses "
                        f"{key}={limit:g}"
                    )
    return crossed


def run(args: argparse.Namespace) -> int:
    section = "quick" if args.quick else "full"
    spec = dict(_QUICK if args.quick else _FULL)
    for key in ("models", "rounds", "steps", "interval"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    try:
        limits = load_thresholds(args.thresholds, section)
        slow = slowdown()
    except ValueError as exc:
        print(f"lm-resiliency bench: {exc}", file=sys.stderr)
        return 2
    spec["job"] = uuid.uuid4().hex[:8]
    per_rank = run_distributed(run_rank, args.world, args=(spec,), timeout_s=args.timeout_s)
    phases = per_rank[0]  # the barriers make every rank's phase times the same to within noise
    summary = summarize(phases)
    crossed = check_thresholds(summary, limits)
    _print(summary)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record = {"kind": "summary", "time": stamp, "section": section, "spec": spec,
              "slowdown": list(slow) if slow else None, "summary": summary,
              "crossed": crossed}  # fmt: skip
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        for i, p in enumerate(phases):
            f.write(
                json.dumps({"kind": "phase", "time": stamp, "job": spec["job"], "index": i, **p})
            )
            f.write("\n")
        f.write(json.dumps(record) + "\n")
    print(f"results appended to {args.results}")
    plotted = args.plot is None or _plot(phases, args.plot)
    for line in crossed:
        print(f"THRESHOLD CROSSED: {line}", file=sys.stderr)
    return 1 if crossed else 0 if plotted else 2


def _print(summary: dict[str, dict[str, dict[str, float | None]]]) -> None:
    head = ("model", "scenario", "steps/s", "ratio", "accounted", "block/capt")
    print("{:8} {:9} {:>8} {:>6} {:>9} {:>10}".format(*head))
    for model, scenarios in summary.items():
        for scenario, s in scenarios.items():
            block = s["blocking_per_capture_s"]
            print(
                f"{model:8} {scenario:9} {s['steps_per_s']:8.2f} {s['step_time_ratio']:6.3f} "
                f"{s['accounted_overhead']:9.4f} "
                f"{'-' if block is None else f'{block * 1e3:.2f} ms':>10}"
            )


def _plot(phases: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "lm-resiliency bench: --plot needs matplotlib, which is not installed; install "
            "the plot extra (pip install 'lm-resiliency[plot]') or leave out --plot (the "
            "results are in the JSON lines either way)",
            file=sys.stderr,
        )
        return False
    models = list(dict.fromkeys(p["model"] for p in phases))
    fig, axes = plt.subplots(len(models), 1, figsize=(8, 3 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        for scenario in SCENARIOS:
            points = [(i, p["steps_per_s"]) for i, p in enumerate(phases)
                      if p["model"] == model and p["scenario"] == scenario]  # fmt: skip
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=scenario)
        ax.set_title(f"{model} model")
        ax.set_xlabel("phase (run order)")
        ax.set_ylabel("steps/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")
    return True

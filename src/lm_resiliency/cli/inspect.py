"""``lm-resiliency inspect DIR``: what a node-local checkpoint folder holds, and is it sound."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lm_resiliency.errors import UnsafePathError
from lm_resiliency.persistence.catalog import RunInfo, ShardInfo, problems, scan, to_json


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "inspect",
        help="list runs, topologies, generations and shards of a node-local checkpoint folder",
        description=(
            "List every run, topology, generation (step) and rank shard under DIR with its size "
            "and trust status, plus each rank's status sidecar. Headers are always validated "
            "(format, identity, tensor table, size); --verify also reads every shard and checks "
            "its CRC-32C values. Entries owned by another user, writable by group or others, "
            "or of the wrong kind (a symlink, a FIFO) are problems. Read-only; run it as the "
            "job's user. Exit code 1 when any shard is unavailable or any entry is unsafe."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the disk_folder of the checkpoint config")
    parser.add_argument("--verify", action="store_true", help="read all data and check every CRC")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the catalog; 0 when every shard is usable, 1 otherwise, 2 when DIR is unreadable."""
    try:
        runs = scan(args.dir, verify=args.verify)
    except (OSError, UnsafePathError) as exc:
        print(f"lm-resiliency inspect: error: cannot read {args.dir}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"dir": args.dir, "verify": args.verify, "runs": to_json(runs)}, indent=1))
    else:
        _print_table(args.dir, runs, verify=args.verify)
    return 1 if problems(runs) else 0


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _shard_state(shard: ShardInfo, verify: bool) -> str:
    if shard.problem is not None:
        return f"UNAVAILABLE ({shard.problem})"
    if not shard.checksums:
        return "ok, no checksums"
    return "ok, CRC verified" if verify else "ok"


def _print_table(folder: str, runs: list[RunInfo], *, verify: bool) -> None:
    if not runs:
        print(f"{folder}: no lm-resiliency runs")
        return
    for run in runs:
        print(f"run {run.name}  run_id={run.run_id!r}")
        for topo in run.topologies:
            print(f"  topology {topo.name}  fingerprint={(topo.topology or '?')[:16]}")
            print(f"    {'step':>10}  {'rank':>5}  {'size':>10}  {'trust':<18}  state")
            for gen in topo.generations:
                for shard in gen.shards:
                    print(
                        f"    {gen.step:>10}  {shard.owner_rank:>5}  {_size(shard.size_bytes):>10}"
                        f"  {shard.trust or '-':<18}  {_shard_state(shard, verify)}"
                    )
            for rank, status in sorted(topo.sidecars.items()):
                print(f"    status rank {rank}: {json.dumps(status)}")
            for stray in topo.stray:
                print(f"    other entry: {stray}")
    for line in problems(runs):
        print(f"problem: {line}")

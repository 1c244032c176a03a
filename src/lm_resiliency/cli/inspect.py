"""``lm-resiliency inspect DIR``: what a node-local checkpoint folder holds, and is it sound."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from lm_resiliency.config import default_memory_folder
from lm_resiliency.errors import UnsafePathError
from lm_resiliency.memory.scan import MemoryScan, SlotInfo, scan_memory
from lm_resiliency.memory.scan import to_json as memory_json
from lm_resiliency.persistence.scan import RunInfo, ShardInfo, problems, scan_checkpoints, to_json
from lm_resiliency.persistence.trust_view import TopologyTrust, trust_report


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "inspect",
        help="list runs, topologies, generations and shards of a node-local checkpoint folder",
        description=(
            "List every run, topology, generation (step) and rank shard under DIR with its size "
            "and trust status, plus each rank's status sidecar. Headers are always validated "
            "(format, identity, tensor table, size, state document) and memory slots are judged "
            "by recovery's own readers; --verify also reads every shard and slot and checks "
            "its CRC-32C values. Entries owned by another user, writable by group or others, "
            "or of the wrong kind (a symlink, a FIFO) are problems. Read-only; run it as the "
            "job's user."
        ),
        epilog=(
            "exit status: 0 every shard and memory slot usable (with --verify: and every CRC "
            "checked); 1 a shard or slot is one recovery refuses, or an entry is unsafe or "
            "unknown; 2 DIR or the memory folder cannot be read, or DIR is itself unsafe; "
            "3 (--verify only) everything usable, but some shards or slots were written without "
            "checksums, so their data was NOT verified (write with verify_integrity=True)"
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the disk_folder of the checkpoint config")
    parser.add_argument("--verify", action="store_true", help="read all data and check every CRC")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.add_argument(
        "--memory-folder",
        default=default_memory_folder(),
        help="also list the memory slots in this memory_folder (default: %(default)s)",
    )
    parser.set_defaults(func=run)


#: ``--verify`` found nothing wrong but could not check the data of some shards.
EXIT_UNVERIFIED = 3


def run(args: argparse.Namespace) -> int:
    """Print the catalog and return the exit status (see the parser's epilog)."""
    try:
        runs = scan_checkpoints(args.dir, verify=args.verify)
    except (OSError, UnsafePathError) as exc:
        print(f"lm-resiliency inspect: error: cannot read {args.dir}: {exc}", file=sys.stderr)
        return 2
    memory = scan_memory(args.memory_folder, verify=args.verify)
    trust = trust_report(args.dir)
    unverified = _unverified(runs) if args.verify else []
    slots_unverified = _unverified_slots(memory) if args.verify else []
    memory_problems = _memory_problems(memory)
    if memory.error is not None:
        code = 2
    elif problems(runs) or memory_problems:
        code = 1
    else:
        code = EXIT_UNVERIFIED if unverified or slots_unverified else 0
    try:
        if args.json:
            doc = {
                "dir": args.dir,
                "verify": args.verify,
                "runs": to_json(runs),
                "memory_folder": args.memory_folder,
                "memory": memory_json(memory),
                "trust": [dataclasses.asdict(t) for t in trust],
            }
            print(json.dumps(doc, indent=1))
        else:
            _print_table(args.dir, runs, verify=args.verify)
            _print_trust(trust)
            _print_memory(args.memory_folder, memory, memory_problems)
            if unverified:
                print(
                    f"NOT verified: {len(unverified)} shard(s) have no checksums, so --verify "
                    "could not check their data (they were written with verify_integrity=False)"
                )
            if slots_unverified:
                print(
                    f"NOT verified: {len(slots_unverified)} memory slot(s) have no checksums, "
                    "so --verify could not check their data"
                )
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (``inspect ... | head``): stop quietly, like other tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return code


def _unverified(runs: list[RunInfo]) -> list[ShardInfo]:
    return [
        shard
        for run in runs
        for topo in run.topologies
        for gen in topo.generations
        for shard in gen.shards
        if shard.problem is None and not shard.checksums
    ]


def _unverified_slots(memory: MemoryScan) -> list[SlotInfo]:
    return [
        slot
        for run in memory.runs
        for rank in run.ranks
        if not rank.live
        for slot in rank.slots
        if slot.problem is None and not slot.verified_crc
    ]


def _memory_problems(memory: MemoryScan) -> list[str]:
    """One line per refused slot and unsafe or unknown entry of the memory folder."""
    out = [memory.error] if memory.error is not None else []
    if memory.disk_markers:
        out.append(
            f"{memory.folder} is not a memory folder: it holds {memory.disk_markers[0]}, which "
            "only a disk checkpoint folder holds"
        )
    return out + memory.all_problems()


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
        return "ok, NOT verified (no checksums)" if verify else "ok, no checksums"
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


def _print_memory(folder: str, memory: MemoryScan, lines: list[str]) -> None:
    if not memory.runs and not lines:
        print(f"{folder}: no memory slots")
    for run in memory.runs:
        print(f"memory run {run.name}  run_id={run.run_id!r}  in {folder}")
        print(f"    {'rank':>5}  {'slot':<12}  {'state':<10}  {'step':>8}  {'owner':>5}  size")
        for rank in run.ranks:
            live = "held by a live process" if rank.live else "no live process"
            for slot in rank.slots:
                state = f"PROBLEM: {slot.problem}" if slot.problem else slot.state
                if slot.verified_crc:
                    state += ", CRC verified"
                step = "-" if slot.step is None else str(slot.step)
                owner = "-" if slot.owner_rank is None else str(slot.owner_rank)
                print(
                    f"    {rank.rank:>5}  {slot.name:<12}  {state:<10}  {step:>8}  {owner:>5}"
                    f"  {_size(slot.size_bytes)}"
                )
            print(f"    rank {rank.rank}: {live}")
    for line in lines:
        print(f"problem: {line}")


def _print_trust(topologies: list[TopologyTrust]) -> None:
    """Each generation's trust (verified / candidate / rejected / unverified) and why."""
    for topo in topologies:
        if not topo.generations and not topo.verdicts and not topo.unreadable:
            continue
        print(f"trust of run {topo.run} topology {topo.topology}:")
        for gen in topo.generations:
            print(f"    step {gen.step:>8}  {gen.trust:<18}  {gen.why}")
        for rank, verdict in sorted(topo.verdicts.items()):
            print(
                f"    rank {rank}: recover in verified mode (SCOUT saw SDC at step "
                f"{verdict.step}: {verdict.reason})"
            )
        for rank, why in sorted(topo.unreadable.items()):
            print(f"    rank {rank}: status sidecar unusable, trust unknown: {why}")

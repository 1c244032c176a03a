"""``lm-resiliency clean``: remove the memory slots (and optionally the files) of stale runs.

A run's memory is never removed because a process died: that is exactly when
a restarted worker needs it. A successful run removes its own slots at
``close()``; what is left on a node belongs to runs that crashed and were
never resumed, and only an operator can say that a run is over. So ``clean``
removes the runs it is told to (``--run RUN_ID``), or every run no live
process holds (``--stale``), and never a rank folder whose lock a live process
holds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from lm_resiliency.config import default_memory_folder
from lm_resiliency.memory.catalog import MemoryRun, scan_memory
from lm_resiliency.persistence import namespace as ns


def register(subparsers: Any) -> None:
    """Add the ``clean`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "clean",
        help="remove the memory slots of finished or abandoned runs (never of live ones)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", metavar="RUN_ID", help="the run id to remove")
    which.add_argument(
        "--stale", action="store_true", help="every run that no live process is using"
    )
    parser.add_argument(
        "--memory-folder",
        default=default_memory_folder(),
        help="the memory_folder of the config (default: %(default)s)",
    )
    parser.add_argument(
        "--disk-folder",
        default=None,
        help="also remove the run's node-local files in this disk_folder (only with --run)",
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    parser.set_defaults(func=run)


def _chosen(runs: list[MemoryRun], args: argparse.Namespace) -> list[MemoryRun]:
    if args.run is not None:
        return [r for r in runs if r.name == ns.run_dir(args.run)]
    return [r for r in runs if not r.live]


def run(args: argparse.Namespace) -> int:
    """0 when everything chosen was removed (or nothing matched), 1 when a live rank was kept."""
    if args.disk_folder is not None and args.run is None:
        print("lm-resiliency clean: --disk-folder needs --run RUN_ID", file=sys.stderr)
        return 2
    verb = "would remove" if args.dry_run else "removed"
    kept_live = False
    freed = 0
    chosen = _chosen(scan_memory(args.memory_folder), args)
    for memory_run in chosen:
        for rank in memory_run.ranks:
            if rank.live:
                kept_live = True
                print(f"kept {rank.path}: a live process holds it")
                continue
            freed += rank.size_bytes
            print(f"{verb} {rank.path} ({len(rank.slots)} slots, {rank.size_bytes} bytes)")
            if not args.dry_run:
                shutil.rmtree(rank.path, ignore_errors=True)
        if not args.dry_run and not memory_run.live:
            shutil.rmtree(Path(args.memory_folder) / memory_run.name, ignore_errors=True)
    if args.disk_folder is not None:
        target = Path(args.disk_folder) / ns.run_dir(args.run)
        if target.is_dir() and not target.is_symlink():
            print(f"{verb} {target}")
            if not args.dry_run:
                shutil.rmtree(target)
    if not chosen and args.disk_folder is None:
        print(f"nothing to clean in {args.memory_folder}")
    else:
        print(f"{verb} {freed} bytes of memory slots")
    return 1 if kept_live else 0

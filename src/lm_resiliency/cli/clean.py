"""``lm-resiliency clean``: remove the memory slots (and optionally the files) of stale runs.

A run's memory is never removed because a process died: that is exactly when
a restarted worker needs it. A successful run removes its own slots at
``close()``; what is left on a node belongs to runs that crashed and were
never resumed, and only an operator can say that a run is over. So ``clean``
removes the runs it is told to (``--run RUN_ID``), or every run no live
process holds (``--stale``). Nothing a live process holds is removed, in
memory or on disk; a folder that is not the kind it was given as (a disk
checkpoint folder as --memory-folder, or the reverse) is refused whole. The
dry run lists every path the real run would remove, and the real run removes
exactly those (one ``unlink``/``rmdir`` each, never a recursive delete).

exit status: 0 everything chosen was removed (or nothing matched); 1 something
was kept (a live process holds it, or it holds entries clean does not know);
2 a folder cannot be read or is not the kind it was given as (nothing removed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
from typing import Any

from lm_resiliency.cli._clean_plan import Plan, Step, WrongKind, disk_plan, memory_plan
from lm_resiliency.config import default_memory_folder
from lm_resiliency.errors import UnsafePathError
from lm_resiliency.memory.scan import MemoryRun, MemoryScan, scan_memory
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.lockprobe import UnknownLock, take_lock


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
    parser.add_argument(
        "--dry-run", action="store_true", help="list every path that would go, remove nothing"
    )
    parser.set_defaults(func=run)


def _chosen(scan: MemoryScan, args: argparse.Namespace) -> list[MemoryRun]:
    if args.run is not None:
        return [r for r in scan.runs if r.name == ns.run_dir(args.run)]
    return [r for r in scan.runs if not r.live]


def _fail(message: str) -> int:
    print(f"lm-resiliency clean: error: {message}; nothing was removed", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Make the plan, print or carry it out; the exit status is in the module docstring."""
    if args.disk_folder is not None and args.run is None:
        print("lm-resiliency clean: --disk-folder needs --run RUN_ID", file=sys.stderr)
        return 2
    scan = scan_memory(args.memory_folder)
    if scan.error is not None:
        return _fail(scan.error)
    plan = Plan()
    chosen = _chosen(scan, args)
    try:
        memory_plan(scan, chosen, plan)
        if args.disk_folder is not None:
            disk_plan(args.disk_folder, args.run, next(iter(chosen), None), plan)
    except WrongKind as exc:
        return _fail(str(exc))
    except (OSError, UnsafePathError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return _fail(f"cannot read {args.disk_folder}: {why}")
    if not plan.steps and not plan.kept:
        print(f"nothing to clean in {args.memory_folder}")
        return 0
    kept = list(plan.kept)
    if args.dry_run:
        for path in plan.paths:
            print(f"would remove {path}")
    else:
        for step in plan.steps:
            kept += _carry_out(step)
    for line in kept:
        print(line)
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(plan.paths)} paths: {plan.slot_bytes} bytes of memory slots, "
        f"{plan.file_bytes} bytes of node-local files"
    )
    return 1 if kept else 0


def _carry_out(step: Step) -> list[str]:
    """Remove ``step``'s paths in order while holding its locks; lines for what stayed."""
    held: list[int] = []
    try:
        for folder, name in step.locks:
            where = os.path.join(folder, name)
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                fd = take_lock(dir_fd, name, where=where)
            except (UnknownLock, OSError) as exc:
                return [f"kept {folder}: {exc}"]
            finally:
                os.close(dir_fd)
            if fd is None:
                return [f"kept {folder}: a live process took {where} while clean ran"]
            held.append(fd)
        out = []
        for path in step.paths:
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    os.rmdir(path)
                else:
                    os.unlink(path)
                print(f"removed {path}")
            except FileNotFoundError:
                print(f"gone already: {path}")
            except OSError as exc:
                out.append(f"kept {path}: {exc.strerror}")
        return out
    finally:
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)

"""Worker script run under real torchrun by the restart and node-loss tests.

Forms the default Gloo group (torch's plain call or ours), all-reduces
``rank + 1`` and prints one line ``RESULT phase=<first|rerun> attempt=<restart
count> rank=<r> world=<n> sum=<s>`` (``rerun``: the --marker existed at start,
i.e. this worker group runs after the fault). Options:

--init plain|ours       which init_process_group to call
--kill-rank R           fault: if --marker does not exist yet, rank R creates it
                        and SIGKILLs itself after the all-reduce, and the other
                        ranks idle (no collective) until the agent stops them;
                        once the marker exists every rank just finishes
--marker PATH           the file that records that the fault already happened
--hold-s S              if --marker does not exist, keep all-reducing every 0.2 s
                        for S seconds (a node can be killed from outside meanwhile)
--rerun-stagger-s S     after the fault, the highest rank starts forming the group
                        S seconds after the others (a worker that starts late, as
                        on a loaded node)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from lm_resiliency.distributed import init_process_group, restart_count

SCRIPT = str(Path(__file__).resolve())
_RESULT = re.compile(r"RESULT phase=(\w+) attempt=(\w+) rank=(\d+) world=(\d+) sum=(\S+)")


class Result(NamedTuple):
    phase: str
    attempt: int | None
    rank: int
    world: int
    sum: float


def results(text: str, phase: str | None = None) -> list[Result]:
    """The RESULT lines in ``text`` (agent output), optionally of one phase, by rank."""
    found = [
        Result(m[1], None if m[2] == "None" else int(m[2]), int(m[3]), int(m[4]), float(m[5]))
        for m in _RESULT.finditer(text)
    ]
    return sorted((r for r in found if phase in (None, r.phase)), key=lambda r: r.rank)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=("plain", "ours"), required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--marker", type=Path, default=None)
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--pg-timeout-s", type=float, default=60.0)
    parser.add_argument("--rerun-deadline-s", type=float, default=0.0)
    parser.add_argument("--rerun-stagger-s", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    first_run = args.marker is None or not args.marker.exists()
    rank = int(os.environ["RANK"])
    timeout = timedelta(seconds=args.pg_timeout_s)
    watchdog = None
    if not first_run and args.rerun_deadline_s > 0:
        # The plain init's failure is sometimes a hang (Gloo keeps retrying the dead
        # group's addresses) rather than an error: bound it so the job ends promptly.
        def expire() -> None:
            print(f"RERUN-HUNG rank={rank}: the restarted group did not form", flush=True)
            os._exit(4)

        watchdog = threading.Timer(args.rerun_deadline_s, expire)
        watchdog.daemon = True
        watchdog.start()
    if not first_run and rank == int(os.environ["WORLD_SIZE"]) - 1:
        time.sleep(args.rerun_stagger_s)
    if args.init == "plain":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        init_process_group("gloo", timeout=timeout)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    if watchdog is not None:
        watchdog.cancel()
    print(
        f"RESULT phase={'first' if first_run else 'rerun'} attempt={restart_count()} "
        f"rank={rank} world={dist.get_world_size()} sum={value.item():g}",
        flush=True,
    )
    if first_run and args.kill_rank >= 0:
        if rank == args.kill_rank:
            assert args.marker is not None, "--kill-rank needs --marker"
            args.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # idle, outside any collective, until the agent stops us
        return 3
    if first_run and args.hold_s > 0:
        deadline = time.monotonic() + args.hold_s
        while time.monotonic() < deadline:
            dist.all_reduce(torch.ones(1))  # raises once a peer is gone
            time.sleep(0.2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``lm-resiliency coordinator``: the live-membership coordinator of one job.

It hosts the job's membership TCPStore and runs the decision loop
(docs/live-membership.md §2): epoch 0 once every rank of the R replica groups
has registered, a new epoch within milliseconds of a lost replica (liveness
EOF, a failure flag, an expired lease). One per job, outside every replica
group; ``lm-resiliency launch`` starts it, multi-node users start it once.

When it listens it writes --ready-file atomically with the JSON
{"host", "port", "live_port", "pid", "generation"}. SIGTERM or SIGINT stop it
with exit status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lm_resiliency.errors import ConfigError
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.coordinator import Coordinator
from lm_resiliency.live.keys import Keys

_TIMINGS = (
    "heartbeat_s",
    "lease_s",
    "stale_s",
    "decision_tick_s",
    "poll_slice_s",
    "ack_timeout_s",
    "reform_timeout_s",
    "coordinator_timeout_s",
    "join_timeout_s",
)


def register(subparsers: Any) -> None:
    """Add the ``coordinator`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "coordinator",
        help="run the live-membership coordinator of a job (one per job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address workers reach it at")
    parser.add_argument(
        "--port", type=int, default=29600, help="store port; 0 picks a free one (%(default)s)"
    )
    parser.add_argument("--run-id", required=True, help="the run id (LMR_LIVE_RUN of the workers)")
    parser.add_argument(
        "--replica-groups",
        type=int,
        required=True,
        metavar="R",
        help="replica groups of a full world",
    )
    parser.add_argument(
        "--nproc-per-group", type=int, required=True, metavar="N", help="ranks per replica group"
    )
    parser.add_argument("--ready-file", type=Path, help="written atomically once listening")
    parser.add_argument(
        "--generation", type=int, default=0, help="coordinator restarts so far (%(default)s)"
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewer surviving replicas: every worker falls back to a whole-job restart",
    )
    defaults = LiveConfig()
    for name in _TIMINGS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=None,
            metavar="S",
            help=f"LiveConfig.{name} in seconds (default {getattr(defaults, name):g})",
        )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s coordinator %(message)s", stream=sys.stderr
    )
    timings = {n: getattr(args, n) for n in _TIMINGS if getattr(args, n) is not None}
    try:
        config = LiveConfig(min_replicas=args.min_replicas, **timings)
        keys = Keys(args.run_id)
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port={args.port} must be 0..65535 (0 picks a free port)")
    except (ConfigError, ValueError) as exc:
        print(f"lm-resiliency coordinator: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = dist.TCPStore(
        args.host,
        args.port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=config.coordinator_timeout_s),
    )
    try:
        coordinator = Coordinator(
            store,
            keys,
            replicas=args.replica_groups,
            nproc_per_group=args.nproc_per_group,
            config=config,
            generation=args.generation,
        )
    except ValueError as exc:
        print(f"lm-resiliency coordinator: {exc}", file=sys.stderr)
        return 2
    try:
        ready = {
            "host": args.host,
            "port": store.port,
            "live_port": coordinator.liveness.port,
            "pid": os.getpid(),
            "generation": args.generation,
        }
        if args.ready_file is not None:
            _write_atomically(args.ready_file, json.dumps(ready))
        logging.info("listening: %s (%s)", ready, dataclasses.asdict(config))
        coordinator.run(stop)
    finally:
        coordinator.close()
        costs = sorted(coordinator.tick_costs_s())
        if costs:
            logging.info(
                "stopped: %d iterations, cost per iteration mean %.3f ms, p99 %.3f ms, max %.3f ms",
                len(costs),
                1e3 * sum(costs) / len(costs),
                1e3 * costs[int(0.99 * (len(costs) - 1))],
                1e3 * costs[-1],
            )
    return 0


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

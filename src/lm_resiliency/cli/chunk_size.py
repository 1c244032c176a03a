"""``lm-resiliency chunk-size``: estimate ``replication_chunk_size`` from prefetch slack."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lm_resiliency.errors import ConfigError
from lm_resiliency.replication.chunking import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    estimate_chunk_size,
)

_MIB = 1024 * 1024


def register(subparsers: Any) -> None:
    """Add the ``chunk-size`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "chunk-size",
        help="estimate replication_chunk_size from NIC bandwidth and prefetch slack",
        description=(
            "Print the replication chunk size whose transfer fits the allowed share of "
            "the all-gather prefetch slack: (layer_compute_ms - ag_time_ms) * "
            "max_ag_delay_fraction at the NIC bandwidth, clamped to [64 KiB, 64 MiB]."
        ),
    )
    parser.add_argument(
        "--nic-bandwidth-gbps",
        type=float,
        required=True,
        metavar="GBPS",
        help="network bandwidth available to replication, in gigabits per second (e.g. 100)",
    )
    parser.add_argument(
        "--layer-compute-ms",
        type=float,
        required=True,
        metavar="MS",
        help="compute time of one layer's forward/backward, in milliseconds (profile it)",
    )
    parser.add_argument(
        "--ag-time-ms",
        type=float,
        required=True,
        metavar="MS",
        help="time of that layer's parameter all-gather (the prefetch), in milliseconds",
    )
    parser.add_argument(
        "--max-ag-delay-fraction",
        type=float,
        required=True,
        metavar="F",
        help="share of the slack (compute - all-gather) a chunk may use, in (0, 1], e.g. 0.1",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the estimate (bytes, then MiB); exit code 2 on an invalid argument."""
    try:
        chunk = estimate_chunk_size(
            nic_bandwidth_gbps=args.nic_bandwidth_gbps,
            layer_compute_ms=args.layer_compute_ms,
            ag_time_ms=args.ag_time_ms,
            max_ag_delay_fraction=args.max_ag_delay_fraction,
        )
    except ConfigError as exc:
        print(f"lm-resiliency chunk-size: error: {exc}", file=sys.stderr)
        return 2
    slack_ms = args.layer_compute_ms - args.ag_time_ms
    print(f"replication_chunk_size = {chunk} bytes ({chunk / _MIB:.2f} MiB)")
    if slack_ms <= 0:
        print(f"no prefetch slack ({slack_ms:g} ms): using the minimum chunk")
    else:
        allowed_ms = slack_ms * args.max_ag_delay_fraction
        clamp = ""
        if chunk in (MIN_CHUNK_BYTES, MAX_CHUNK_BYTES):
            clamp = ", clamped to [64 KiB, 64 MiB]"
        print(
            f"slack {slack_ms:g} ms x {args.max_ag_delay_fraction:g} = {allowed_ms:g} ms at "
            f"{args.nic_bandwidth_gbps:g} Gb/s{clamp}"
        )
    return 0

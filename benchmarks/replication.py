"""Replication throughput vs the raw Gloo isend/irecv limit, two ranks on loopback.

Both ranks exchange arenas of each size in both directions at once: with a plain
loop of Gloo ``isend``/``irecv`` over the same chunks, every chunk posted at once
(the transport's limit), once on one group ("raw") and once with one group per
direction as our channel uses ("raw-2g"); then with ``ReplicationChannel.exchange``
(header, validation, pipelined chunks, ack). Each measurement is repeated and the
median taken; the modes alternate so drift in machine load hits all alike.

Run: ``python benchmarks/replication.py`` (add ``--sizes-mib 64`` for a quick
look). Prints a table and one JSON line. Target: ours >= 80 % of raw at the
default 16 MiB chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.capture import Layout, allocate_arena
from lm_resiliency.knobs import REPLICATION_CHUNK_BYTES
from lm_resiliency.replication import PairingPlan, ReplicationChannel
from lm_resiliency.replication.header import make_header
from lm_resiliency.testing import run_distributed

MIB = 1024 * 1024
RUN = "bench-replication"


def _raw_exchange(
    send_group: Any, recv_group: Any, peer: int, send: torch.Tensor, recv: torch.Tensor, chunk: int
) -> None:
    works = []
    for offset in range(0, send.numel(), chunk):
        end = min(offset + chunk, send.numel())
        works.append(dist.isend(send[offset:end], group_dst=peer, group=send_group))
        works.append(dist.irecv(recv[offset:end], group_src=peer, group=recv_group))
    for work in works:
        work.wait()


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def _rank(
    rank: int,
    world: int,
    sizes_mib: list[int],
    chunks_mib: list[int],
    repeats: int,
    max_in_flight: int,
) -> list[dict[str, Any]]:
    peer = 1 - rank
    one_group = dist.new_group(backend="gloo")
    # Our channel gives each direction its own group (its own socket and Gloo
    # thread); the second raw variant does the same, to isolate the protocol's cost.
    per_direction = [dist.new_group(backend="gloo") for _ in range(2)]
    plan = PairingPlan.build(2, 1)
    channels = {
        c: ReplicationChannel(
            plan, run_id=RUN, chunk_bytes=c * MIB, timeout_s=120, max_in_flight=max_in_flight
        )
        for c in chunks_mib
    }
    splits = (per_direction[rank], per_direction[peer])

    def ours(chunk_mib: int, step: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        layout = Layout.from_tensors([send], ["arena"])
        channels[chunk_mib].exchange(
            step=step,
            send_header=make_header(RUN, rank, step, layout, {"step": step}),
            send_arena=send,
            recv_alloc=lambda header: recv,
        )

    # Warm-up: the first message on a fresh group pays its connection setup.
    small_send, small_recv = allocate_arena(MIB, pin=False), allocate_arena(MIB, pin=False)
    for group_pair in ((one_group, one_group), splits):
        _raw_exchange(*group_pair, peer, small_send, small_recv, MIB)
    for chunk_mib in chunks_mib:
        ours(chunk_mib, 0, small_send, small_recv)

    rows = []
    for size_mib in sizes_mib:
        send = allocate_arena(size_mib * MIB, pin=False)
        send.fill_(rank + 1)
        recv = allocate_arena(size_mib * MIB, pin=False)
        for chunk_mib in chunks_mib:
            chunk = chunk_mib * MIB
            times: dict[str, list[float]] = {"raw": [], "raw2": [], "ours": []}
            for rep in range(1, repeats + 1):
                args = (peer, send, recv, chunk)
                times["raw"].append(_timed(_raw_exchange, one_group, one_group, *args))
                times["raw2"].append(_timed(_raw_exchange, *splits, *args))
                times["ours"].append(_timed(ours, chunk_mib, rep, send, recv))
            if not bool((recv == peer + 1).all()):
                raise AssertionError("received bytes are not the peer's")
            rows.append({"size_mib": size_mib, "chunk_mib": chunk_mib, **times})
    for channel in channels.values():
        channel.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--chunks-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-in-flight", type=int, default=4)
    args = parser.parse_args()

    per_rank = run_distributed(
        _rank,
        2,
        args=(args.sizes_mib, args.chunks_mib, args.repeats, args.max_in_flight),
        timeout_s=3600,
        pg_timeout_s=600,
    )

    def median_s(a: list[float], b: list[float]) -> float:
        # A repetition lasts until the slower rank finished.
        return statistics.median(max(x, y) for x, y in zip(a, b, strict=True))

    print(
        f"replication throughput per direction, both directions at once, 2 ranks on loopback, "
        f"{os.cpu_count()} CPUs, median of {args.repeats}, max_in_flight={args.max_in_flight}"
    )
    print(
        f"{'arena':>9} {'chunk':>7} {'raw':>6} {'raw-2g':>7} {'ours':>6}  (GB/s)"
        f"  {'ours/raw':>8} {'ours/raw-2g':>11}"
    )
    results = []
    for r0, r1 in zip(*per_rank, strict=True):
        nbytes = r0["size_mib"] * MIB
        raw, raw2, ours = (median_s(r0[k], r1[k]) for k in ("raw", "raw2", "ours"))
        row = {
            "size_mib": r0["size_mib"],
            "chunk_mib": r0["chunk_mib"],
            "raw_gbps": round(nbytes / raw / 1e9, 3),
            "raw_two_groups_gbps": round(nbytes / raw2 / 1e9, 3),
            "ours_gbps": round(nbytes / ours / 1e9, 3),
            "ratio": round(raw / ours, 3),
            "ratio_vs_two_groups": round(raw2 / ours, 3),
        }
        results.append(row)
        print(
            f"{row['size_mib']:>5} MiB {row['chunk_mib']:>3} MiB {row['raw_gbps']:>6.2f} "
            f"{row['raw_two_groups_gbps']:>7.2f} {row['ours_gbps']:>6.2f}          "
            f"{row['ratio']:>8.2f} {row['ratio_vs_two_groups']:>11.2f}"
        )
    default = [r for r in results if r["chunk_mib"] * MIB == REPLICATION_CHUNK_BYTES]
    summary = {
        "benchmark": "replication",
        "unit": "GB/s per direction (1e9 bytes/s), both directions concurrently",
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "max_in_flight": args.max_in_flight,
        "target_ratio_at_default_chunk": 0.8,
        "ratio_at_default_chunk": {str(r["size_mib"]): r["ratio"] for r in default},
        "ratio_vs_two_groups_at_default_chunk": {
            str(r["size_mib"]): r["ratio_vs_two_groups"] for r in default
        },
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Heal transfer rate (live/heal.py) vs raw Gloo send/recv of the same bytes, two ranks on loopback.

Rank 0 is the donor, rank 1 the joiner. For each state size (a tree of 8 float32 tensors plus
its step and sampler position), in one run and alternating so that drift in machine load hits
both alike:

* **raw**: Gloo ``isend``/``irecv`` of the same bytes in the transport's chunks, every chunk
  posted at once, on an already-connected two-rank group (the wire's limit);
* **fresh**: the same, received into a freshly allocated tensor, as a joiner must (it has no
  buffer of the donor's layout): the kernel maps the new pages during the receive. On a VM
  first-touched pages are slow, so this is the floor for a receiver without memory;
* **heal**: ``heal.serve`` on rank 0 and ``heal.receive`` on rank 1, as a real heal runs them:
  the key published on the store, a fresh two-rank Gloo group per heal (its rendezvous
  included), the header, the chunks read straight from the live tensors with a CRC-32C each,
  the trailer, the ack, the donor's state digest (computed while the bytes move) and the
  decode into a tree. Not included: the joiner's load and its digest of the loaded state,
  printed separately ("load+digest"), since their cost is that of the user's restore path.
  "wire" is the TorchTransfer ``recv`` alone (rendezvous, header, chunks with their CRC-32C,
  trailer, ack), to tell the transport's cost from the heal's own.

Run: ``python benchmarks/live_heal.py`` (``--sizes-mib 64`` for a quick look). Prints a table
and one JSON line. Target: heal >= 0.8x raw ("heal/fresh" is the ratio to the floor above).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.knobs import REPLICATION_CHUNK_BYTES
from lm_resiliency.live import heal
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import EpochRecord, Keys
from lm_resiliency.testing import run_distributed

MIB = 1024 * 1024


@dataclass
class _Peer:
    """One endpoint of the heal (what ``heal.HealPeer`` asks: keys, rank, config, a store)."""

    keys: Keys
    group_rank: int
    config: LiveConfig

    def store(self) -> dist.Store:
        return dist.distributed_c10d._get_default_store()


def _tree(nbytes: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = nbytes // 4 // 8
    return {
        "model": {f"layer{i}": torch.randn(n, generator=gen) for i in range(8)},
        "step": 7,
        "sampler": {"seed": seed, "position": 7},
    }


def _raw(group: Any, rank: int, flat: torch.Tensor, chunk: int) -> None:
    works = []
    for offset in range(0, flat.numel(), chunk):
        piece = flat[offset : min(offset + chunk, flat.numel())]
        if rank == 0:
            works.append(dist.isend(piece, group_dst=1, group=group))
        else:
            works.append(dist.irecv(piece, group_src=0, group=group))
    for work in works:
        work.wait()


def _rank(rank: int, world: int, sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    peer = _Peer(Keys("bench-heal"), 0, LiveConfig(heal_timeout_s=300.0, poll_slice_s=0.001))
    group = dist.new_group(backend="gloo")
    chunk = REPLICATION_CHUNK_BYTES
    epoch = 0
    rows = []
    for size_mib in sizes_mib:
        nbytes = size_mib * MIB
        donor = _tree(nbytes, 1)
        mine = _tree(nbytes, 2)  # the joiner's own (stale) state, overwritten by the heal
        flat = torch.cat(
            [t.view(torch.uint8) for t in (donor if rank == 0 else mine)["model"].values()]
        )
        times: dict[str, list[float]] = {
            "raw": [], "fresh": [], "heal": [], "load": [], "wire": []
        }  # fmt: skip
        _raw(group, rank, flat[:MIB], MIB)  # connect the raw group
        for _ in range(repeats + 1):  # the first round warms up both paths
            dist.barrier()
            t0 = time.perf_counter()
            _raw(group, rank, flat, chunk)
            raw_s = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            _raw(group, rank, flat if rank == 0 else torch.empty_like(flat), chunk)
            fresh_s = time.perf_counter() - t0
            epoch += 1
            record = EpochRecord(epoch=epoch, members=(0,), reason="admit",
                                 heal={"joiner": 1, "donor": 0, "step": 7})  # fmt: skip
            dist.barrier()
            t0 = time.perf_counter()
            load_s = 0.0
            if rank == 0:
                heal.serve(donor, peer, record)
            else:
                healed = heal.receive(peer, record)
            heal_s = time.perf_counter() - t0
            if rank == 1:
                t1 = time.perf_counter()
                for name, t in mine["model"].items():
                    t.copy_(healed.tree["model"][name])
                mine["sampler"] = dict(healed.tree["sampler"])
                if heal.state_digest(mine) != healed.digest:
                    raise AssertionError("the healed state's digest is not the donor's")
                load_s = time.perf_counter() - t1
            times["raw"].append(raw_s)
            times["fresh"].append(fresh_s)
            times["heal"].append(heal_s)
            times["load"].append(load_s)
            times["wire"].append(healed.transfer_s if rank == 1 else 0.0)
        rows.append({"size_mib": size_mib, **{k: v[1:] for k, v in times.items()}})
    return rows


def measure(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    """One row per state size: raw, fresh, heal and wire rates and their ratios (2 ranks)."""
    per_rank = run_distributed(
        _rank, 2, args=(sizes_mib, repeats), timeout_s=3600, pg_timeout_s=600
    )

    def median_s(a: list[float], b: list[float]) -> float:
        return statistics.median(max(x, y) for x, y in zip(a, b, strict=True))

    results = []
    for r0, r1 in zip(*per_rank, strict=True):
        nbytes = r0["size_mib"] * MIB
        raw, ours = median_s(r0["raw"], r1["raw"]), median_s(r0["heal"], r1["heal"])
        fresh = median_s(r0["fresh"], r1["fresh"])
        load = statistics.median(r1["load"])
        wire = statistics.median(r1["wire"])
        row = {
            "size_mib": r0["size_mib"],
            "raw_gbps": round(nbytes / raw / 1e9, 3),
            "raw_fresh_gbps": round(nbytes / fresh / 1e9, 3),
            "heal_gbps": round(nbytes / ours / 1e9, 3),
            "ratio": round(raw / ours, 3),
            "ratio_fresh": round(fresh / ours, 3),
            "heal_s": round(ours, 4),
            "transport_gbps": round(nbytes / wire / 1e9, 3),
            "joiner_load_and_digest_s": round(load, 4),
        }
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = measure(args.sizes_mib, args.repeats)
    print(
        f"heal transfer vs raw Gloo send/recv, one direction, 2 ranks on loopback, "
        f"{os.cpu_count()} CPUs, median of {args.repeats}, "
        f"chunk {REPLICATION_CHUNK_BYTES // MIB} MiB"
    )
    print(
        f"{'state':>9} {'raw':>6} {'fresh':>6} {'heal':>6} {'wire':>6} (GB/s) {'heal/raw':>8} "
        f"{'heal/fresh':>10} {'load+digest':>12}"
    )
    for row in results:
        load = row["joiner_load_and_digest_s"]
        print(
            f"{row['size_mib']:>5} MiB {row['raw_gbps']:>6.2f} {row['raw_fresh_gbps']:>6.2f} "
            f"{row['heal_gbps']:>6.2f} {row['transport_gbps']:>6.2f}        "
            f"{row['ratio']:>8.2f} {row['ratio_fresh']:>10.2f} {load:>10.3f} s"
        )
    summary = {
        "benchmark": "live_heal",
        "unit": "GB/s (1e9 bytes/s), donor to joiner",
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "chunk_bytes": REPLICATION_CHUNK_BYTES,
        "target_ratio": 0.8,
        "ratio": {str(r["size_mib"]): r["ratio"] for r in results},
        "ratio_fresh": {str(r["size_mib"]): r["ratio_fresh"] for r in results},
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

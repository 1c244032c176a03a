"""GEMINI node-local persistence: format-v3 write/read vs the raw disk and vs torch.save/load.

For arenas of 256 MiB and 1 GiB (about 100 fp32 tensors), in one run on one disk:

* raw limits: write+fsync of the same bytes to a new file, and overwriting an
  existing file in place + fsync; a raw read of the file into a fresh buffer;
* ``ShardStore.write`` (temp file, fsync, rename, directory fsync, sidecar,
  retention with keep=2) in steady state, without and with integrity (CRC-32C),
  with retired files recycled as the next temp file and without recycling;
* ``ShardStore.read`` without and with CRC checks vs the raw read and vs
  ``torch.load(weights_only=True)`` of a ``torch.save``'d dict of the same tensors
  (the incumbent). Reads are cold: the file's pages are evicted first
  (``posix_fadvise(DONTNEED)`` after an fsync).

Targets: persisting >= 80% of raw new-file throughput without integrity;
integrity adds <= 15% time. Prints a table and one JSON line. Not a test.
Usage: python benchmarks/persistence.py [--sizes-mib 256 1024] [--repeats 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lm_resiliency.capture import Layout
from lm_resiliency.persistence import ShardStore

MiB = 1024 * 1024
_CHUNK = 64 * MiB


def make_state(total_bytes: int, n: int = 100) -> tuple[list[torch.Tensor], list[str]]:
    per = total_bytes // n // 4
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(per, generator=g) for _ in range(n)]
    return tensors, [f"layers.{i}.weight" for i in range(n)]


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time(fn: Callable[[], Any], repeats: int, before: Callable[[], None] | None = None) -> float:
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _raw_write(path: Path, view: memoryview, *, new: bool) -> None:
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if new else 0)
    fd = os.open(path, flags, 0o600)
    try:
        for off in range(0, len(view), _CHUNK):
            piece = view[off : off + _CHUNK]
            while len(piece):
                piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path: Path, nbytes: int) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy())  # type: ignore[arg-type]
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            done += os.preadv(fd, [view[done : done + _CHUNK]], done)
    finally:
        os.close(fd)
    return out


def bench_size(root: Path, total_bytes: int, repeats: int) -> dict[str, float]:
    tensors, names = make_state(total_bytes)
    layout = Layout.from_tensors(tensors, names)
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for v, t in zip(layout.views(arena), tensors, strict=True):
        v.copy_(t)
    view = memoryview(arena.numpy())  # type: ignore[arg-type]
    nbytes = layout.total_bytes
    res: dict[str, float] = {"bytes": float(nbytes)}

    raw = root / "raw.bin"

    def unlink_raw() -> None:
        raw.unlink(missing_ok=True)

    res["raw_new_s"] = _time(lambda: _raw_write(raw, view, new=True), repeats, unlink_raw)
    _raw_write(raw, view, new=True)
    res["raw_overwrite_s"] = _time(lambda: _raw_write(raw, view, new=False), repeats)
    t0 = time.perf_counter()
    raw.unlink()
    res["unlink_s"] = time.perf_counter() - t0

    step = 0
    kept: ShardStore | None = None  # the plain, recycling store: its file feeds the raw read
    for integrity in (False, True):
        for recycle in (True, False):
            folder = root / f"store-{integrity}-{recycle}"
            store = ShardStore(
                folder,
                run_id="bench",
                topology="t",
                rank=0,
                verify_integrity=integrity,
                recycle_files=recycle,
            )

            def write(store: ShardStore = store) -> None:
                nonlocal step
                step += 1
                store.write(owner_rank=0, step=step, layout=layout, arena=arena, state_document={})

            for _ in range(3):  # steady state: retention active, spares parked
                write()
            tag = "crc" if integrity else "plain"
            res[f"persist_{tag}_{'recycle' if recycle else 'new'}_s"] = _time(write, repeats)
            if recycle:
                path = store.path_for(0, step)
                res[f"load_{tag}_s"] = _time(
                    lambda store=store, s=step: store.read(owner_rank=0, step=s),
                    repeats,
                    lambda p=path: _evict(p),
                )
            if recycle and not integrity:
                kept, raw_src = store, path
            else:
                store.close()
                shutil.rmtree(folder)

    res["raw_read_s"] = _time(
        lambda: _raw_read(raw_src, raw_src.stat().st_size), repeats, lambda: _evict(raw_src)
    )
    pt = root / "state.pt"
    torch.save(dict(zip(names, tensors, strict=True)), pt)
    res["torch_load_s"] = _time(
        lambda: torch.load(pt, weights_only=True), repeats, lambda: _evict(pt)
    )
    pt.unlink()
    assert kept is not None
    kept.close()
    shutil.rmtree(root / "store-False-True")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: cwd)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="lmr-bench-persist-", dir=args.dir or os.getcwd()))
    results: dict[str, dict[str, float]] = {}
    try:
        for mib in args.sizes_mib:
            results[f"{mib}MiB"] = bench_size(root, mib * MiB, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def gbps(r: dict[str, float], key: str) -> float:
        return r["bytes"] / r[key] / 1e9

    rows = [
        ("raw new file write+fsync", "raw_new_s"),
        ("raw overwrite in place+fsync", "raw_overwrite_s"),
        ("persist, no CRC, recycled file", "persist_plain_recycle_s"),
        ("persist, no CRC, new file", "persist_plain_new_s"),
        ("persist, CRC, recycled file", "persist_crc_recycle_s"),
        ("persist, CRC, new file", "persist_crc_new_s"),
        ("raw read (cold)", "raw_read_s"),
        ("load, no CRC (cold)", "load_plain_s"),
        ("load, CRC (cold)", "load_crc_s"),
        ("torch.load weights_only (cold)", "torch_load_s"),
    ]
    print(f"{'operation':<34}" + "".join(f"{k:>20}" for k in results))
    for label, key in rows:
        cells = "".join(
            f"{r[key] * 1e3:>10.0f} ms {gbps(r, key):>4.2f}GB/s" for r in results.values()
        )
        print(f"{label:<34}{cells}")
    print(
        f"{'unlink of the raw file':<34}"
        + "".join(f"{r['unlink_s'] * 1e3:>17.0f} ms" for r in results.values())
    )

    summary: dict[str, Any] = {"benchmark": "persistence"}
    for size, r in results.items():
        best = min(r["persist_plain_recycle_s"], r["persist_plain_new_s"])
        summary[size] = {
            "persist_vs_raw_new": round(r["raw_new_s"] / best, 3),
            "persist_new_file_vs_raw_new": round(r["raw_new_s"] / r["persist_plain_new_s"], 3),
            "recycle_speedup": round(r["persist_plain_new_s"] / r["persist_plain_recycle_s"], 3),
            "integrity_overhead": round(
                r["persist_crc_recycle_s"] / r["persist_plain_recycle_s"] - 1, 3
            ),
            "integrity_overhead_new_file": round(
                r["persist_crc_new_s"] / r["persist_plain_new_s"] - 1, 3
            ),
            "load_vs_raw_read": round(r["raw_read_s"] / r["load_plain_s"], 3),
            "load_crc_vs_raw_read": round(r["raw_read_s"] / r["load_crc_s"], 3),
            "load_speedup_vs_torch_load": round(r["torch_load_s"] / r["load_plain_s"], 3),
            "persist_gbps": round(r["bytes"] / best / 1e9, 3),
            "raw_new_gbps": round(gbps(r, "raw_new_s"), 3),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

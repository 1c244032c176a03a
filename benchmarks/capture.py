"""GEMINI capture: blocking time and time-until-safe vs memcpy and DCP async_save.

For a GPT-style state (model + AdamW, 385 tensors) of 256 MiB and 1 GiB, its model and
optimizer parts in ``state.Deferred`` as ``enable_resiliency`` builds them, in one run:

* ``save()`` blocking (median of >= 10 captures) and time until the state is safe
  to modify (``save()`` start -> ``maybe_wait()`` return), with the slots as files
  on /dev/shm (the default: they outlive the process) and in anonymous process
  memory (``memory_folder=None``), and the ratio of the two;
* the memcpy limit: ``copy_`` of the same bytes into a pre-faulted buffer;
* ``torch.distributed.checkpoint.async_save`` in its default form and its best
  form (a long-lived ``DefaultStager`` with ``use_async_staging=True``):
  blocking (return of ``async_save``) and time until safe (staging complete);
* the slowdown of a foreground compute loop while one capture copies, unthrottled
  and with ``copy_rate_limit_bytes_per_s`` of 1 GB/s and 0.5 GB/s;
* growth in tensor count at fixed bytes (``--counts``, default 385, 4,000 and
  40,000 tensors of ``--count-mib`` MiB in all): ``save()`` of the tree with its
  model and optimizer parts in ``state.Deferred`` (as ``enable_resiliency``
  builds it: walked by the capture worker) and of the same tree without it
  (walked in ``save()``), time until safe, memcpy, DCP's best ``async_save``
  return, and the front door's blocking per capture (post-step hook launch + the
  next pre-step hook's wait; min and median) for a plain module of about as many
  tensors (Linear layers + AdamW), with the ratios of DCP's best return to both.

Prints tables and one JSON line. Not part of the test suite.
Usage: python benchmarks/capture.py [--sizes-mib 256 1024] [--captures 10]
       [--counts 385 4000 40000] [--count-mib 64] [--skip-sizes]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.state import Deferred

MiB = 1024 * 1024


def gpt_state(total_bytes: int, n_layers: int = 12) -> dict[str, Any]:
    """A GPT-style fp32 model + AdamW state of about ``total_bytes`` (~8 tensors per layer x 3)."""
    params_bytes = total_bytes // 3
    # 12 * d^2 fp32 weights per layer -> choose d so the model holds params_bytes
    d = int((params_bytes / (12 * n_layers * 4)) ** 0.5)
    model: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        p = f"layers.{i}."
        model[p + "ln1.weight"] = torch.randn(d)
        model[p + "ln1.bias"] = torch.randn(d)
        model[p + "attn.qkv.weight"] = torch.randn(3 * d, d)
        model[p + "attn.qkv.bias"] = torch.randn(3 * d)
        model[p + "attn.proj.weight"] = torch.randn(d, d)
        model[p + "ln2.weight"] = torch.randn(d)
        model[p + "mlp.fc.weight"] = torch.randn(4 * d, d)
        model[p + "mlp.proj.weight"] = torch.randn(d, 4 * d)
    opt_state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn_like(t),
            "exp_avg_sq": torch.rand_like(t),
        }
        for i, t in enumerate(model.values())
    }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "params": list(range(len(model))),
        }
    ]
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": groups},
        "step": 10,
        "rng": torch.get_rng_state(),
    }


def tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_ours(state: dict[str, Any], captures: int, memory: str | None) -> dict[str, float]:
    save_s, safe_s, b2b_s = [], [], []
    cfg = InMemoryCkptConfig(
        pin_memory=True, disk_flush_interval=0, memory_folder=memory, run_id="bench-capture"
    )
    with InMemoryCheckpointManager(cfg) as m:
        for step in range(captures + 2):
            # The training steps between two captures: the previous cycle (copy, then the
            # slot's CRC-32C on the worker) is done by the next save(), as it is at any
            # interval whose steps outlast the cycle. The back-to-back case is timed below.
            m.wait_persisted()
            t0 = time.perf_counter()
            m.save(state, step)
            t1 = time.perf_counter()
            m.maybe_wait()
            t2 = time.perf_counter()
            if step >= 2:  # the first two captures allocate and pre-fault the two own slots
                save_s.append(t1 - t0)
                safe_s.append(t2 - t0)
        for step in range(captures + 2, 2 * captures + 2):
            # Back to back (interval 1 with steps shorter than the cycle): save() waits for
            # the previous cycle's CRC pass, which maybe_wait() does not cover.
            t0 = time.perf_counter()
            m.save(state, step)
            b2b_s.append(time.perf_counter() - t0)
            m.maybe_wait()
        arena = m.arena_bytes()
        m.wait_persisted()
        crc_s = m.stats.crc_s[2:]  # the worker's CRC-32C pass, after maybe_wait() returned
    crc = med(crc_s) if crc_s else float("nan")
    return {
        "crc_ms": crc * 1e3,
        "crc_gb_per_s": arena / 2 / crc / 1e9 if crc_s else float("nan"),
        "save_ms": med(save_s) * 1e3,
        "save_max_ms": max(save_s) * 1e3,
        "save_back_to_back_ms": med(b2b_s) * 1e3,
        "safe_ms": med(safe_s) * 1e3,
        "arena_bytes": arena,
    }


def bench_memcpy(state: dict[str, Any], reps: int) -> dict[str, float]:
    ts = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.zero_()
    views, off = [], 0
    for t in ts:
        n = t.numel() * t.element_size()
        views.append(dst[off : off + n].view(t.dtype).view(t.shape))
        off += n
    flat_src = torch.empty(nbytes, dtype=torch.uint8)
    flat_src.fill_(1)
    per_tensor, flat = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for v, t in zip(views, ts):
            v.copy_(t)
        per_tensor.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(flat_src)
        flat.append(time.perf_counter() - t0)
    return {"memcpy_ms": med(per_tensor) * 1e3, "memcpy_flat_ms": med(flat) * 1e3}


def bench_dcp(state: dict[str, Any], reps: int, best: bool) -> dict[str, float] | None:
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    root = tempfile.mkdtemp(prefix="bench-dcp-")
    ret_s, safe_s = [], []
    stager = None
    if best:
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=torch.cuda.is_available(),
            )
        )
    try:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            if stager is not None:
                resp = dcp.async_save(
                    state, checkpoint_id=f"{root}/c{i}", async_stager=stager, no_dist=True
                )
                t1 = time.perf_counter()
                resp.staging_completion.result()  # type: ignore[union-attr]
                t2 = time.perf_counter()
                resp.upload_completion.result()  # type: ignore[union-attr]
            else:
                fut = dcp.async_save(state, checkpoint_id=f"{root}/c{i}", no_dist=True)
                t1 = time.perf_counter()
                t2 = t1  # the default form stages before returning
                fut.result()  # type: ignore[union-attr]
            shutil.rmtree(f"{root}/c{i}", ignore_errors=True)
            if i >= 1:
                ret_s.append(t1 - t0)
                safe_s.append(t2 - t0)
    finally:
        if stager is not None:
            stager.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"return_ms": med(ret_s) * 1e3, "safe_ms": med(safe_s) * 1e3}


def foreground_slowdown(state: dict[str, Any], rate: int | None) -> float:
    """Foreground matmul loop rate when idle / while one capture's copy is in flight."""
    a = torch.randn(256, 256)

    def loop(keep_going: Any, limit_s: float) -> float:
        n, t0 = 0, time.perf_counter()
        while keep_going() and time.perf_counter() - t0 < limit_s:
            a @ a
            n += 1
        return n / (time.perf_counter() - t0)

    idle = loop(lambda: True, 1.0)
    cfg = InMemoryCkptConfig(copy_rate_limit_bytes_per_s=rate, disk_flush_interval=0)
    with InMemoryCheckpointManager(cfg) as m:
        for step in range(2):  # allocate and pre-fault both own slots first
            m.save(state, step)
            m.maybe_wait()
        m.save(state, 2)
        in_flight = m._engine._cycle
        assert in_flight is not None
        busy = loop(lambda: not in_flight.captured.is_set(), 30.0)
        m.maybe_wait()
    return idle / busy


def deferred(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its model and optimizer parts walked by the capture worker."""
    return {**state, "model": Deferred(state["model"]), "optimizer": Deferred(state["optimizer"])}


def bench_front_door(n_tensors: int, captures: int) -> dict[str, float]:
    """Blocking per capture through enable_resiliency for Linear layers + AdamW (8 tensors each)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(max(1, n_tensors // 8))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    folder = tempfile.mkdtemp(prefix="bench-capture-fd-")
    # A run id of this process: two benchmark runs on one machine must not share a slot folder.
    cfg = InMemoryCkptConfig(
        disk_folder=folder, disk_flush_interval=0, run_id=f"bench-fd-{os.getpid()}"
    )
    try:
        with enable_resiliency(model, opt, interval=2, config=cfg) as handle:
            for _ in range(2 * (captures + 2)):
                step()
                # Steps that outlast the capture cycle (as bench_ours): the next step's
                # pre-step hook finds the copy done; what the hooks block is the boundary.
                handle.manager.wait_persisted()
            launch = handle.stats.launch_s[2:]  # the first encodes on the caller; 2nd allocates
            wait = handle.stats.wait_s[2:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    blocking = [a + b for a, b in zip(launch, wait, strict=False)]
    return {
        "fd_tensors": 8 * len(model),
        "fd_blocking_ms": med(blocking) * 1e3,
        "fd_blocking_min_ms": min(blocking) * 1e3,
        "fd_launch_ms": med(launch) * 1e3,
        "fd_wait_ms": med(wait) * 1e3,
    }


def count_rows(counts: list[int], mib: int, captures: int, skip_dcp: bool) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        state = gpt_state(mib * MiB, n_layers=max(1, (n - 1) // 32))
        ts = tensors_of(state)
        shm = tempfile.mkdtemp(prefix="lmr-bench-capture-", dir="/dev/shm")
        try:
            ours = bench_ours(deferred(state), captures, f"{shm}/slots")
            plain = bench_ours(state, max(3, captures // 3), f"{shm}/plain")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        mem = bench_memcpy(state, 3)
        row: dict[str, Any] = {
            "tensors": len(ts),
            "size_mib": round(sum(t.numel() * t.element_size() for t in ts) / MiB),
            "save_ms": ours["save_ms"],
            "save_max_ms": ours["save_max_ms"],
            "save_not_deferred_ms": plain["save_ms"],
            "safe_ms": ours["safe_ms"],
            **mem,
            "safe_over_memcpy": ours["safe_ms"] / mem["memcpy_ms"],
            "memcpy_over_save": mem["memcpy_ms"] / ours["save_ms"],
            **bench_front_door(n, captures),
        }
        if not skip_dcp:
            best = bench_dcp(state, 2, best=True)
            if best:
                row["dcp_best_return_ms"] = best["return_ms"]
                row["dcp_best_return_over_save"] = best["return_ms"] / ours["save_ms"]
                row["dcp_best_return_over_fd"] = best["return_ms"] / row["fd_blocking_ms"]
                row["dcp_best_return_over_fd_min"] = best["return_ms"] / row["fd_blocking_min_ms"]
        rows.append(row)
        del state, ts
    return rows


def print_counts(rows: list[dict[str, Any]]) -> None:
    nan = float("nan")
    print(
        f"{'tensors':>8} {'MiB':>5} {'save ms':>8} {'(no Deferred)':>13} {'safe ms':>8} "
        f"{'memcpy ms':>9} {'DCP best ret':>12} {'DCP/save':>9} {'front door min/med ms':>21} "
        f"{'(launch+wait)':>15} {'DCP/fd min/med':>15}"
    )
    for r in rows:
        print(
            f"{r['tensors']:>8} {r['size_mib']:>5} {r['save_ms']:>8.3f} "
            f"{r['save_not_deferred_ms']:>13.2f} {r['safe_ms']:>8.1f} {r['memcpy_ms']:>9.1f} "
            f"{r.get('dcp_best_return_ms', nan):>12.2f} "
            f"{r.get('dcp_best_return_over_save', nan):>8.1f}x "
            f"{r['fd_blocking_min_ms']:>10.3f}/{r['fd_blocking_ms']:<10.3f} "
            f"{r['fd_launch_ms']:>7.3f}+{r['fd_wait_ms']:<7.3f} "
            f"{r.get('dcp_best_return_over_fd_min', nan):>7.1f}x/"
            f"{r.get('dcp_best_return_over_fd', nan):<6.1f}x"
        )
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(
            f"growth {a['tensors']} -> {b['tensors']} tensors "
            f"({b['tensors'] / a['tensors']:.0f}x): "
            f"save() {b['save_ms'] / a['save_ms']:.2f}x, front door "
            f"{b['fd_blocking_ms'] / a['fd_blocking_ms']:.2f}x, not deferred "
            f"{b['save_not_deferred_ms'] / a['save_not_deferred_ms']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--captures", type=int, default=10)
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--counts", type=int, nargs="*", default=[385, 4000, 40000])
    ap.add_argument("--count-mib", type=int, default=64)
    ap.add_argument("--skip-sizes", action="store_true", help="only the tensor-count rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    counts = count_rows(args.counts, args.count_mib, args.captures, args.skip_dcp)
    rows = []
    for size in [] if args.skip_sizes else args.sizes_mib:
        state = gpt_state(size * MiB)
        nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
        shm = tempfile.mkdtemp(prefix="lmr-bench-capture-", dir="/dev/shm")
        try:
            ours = bench_ours(deferred(state), args.captures, f"{shm}/slots")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        anon = bench_ours(deferred(state), args.captures, None)
        mem = bench_memcpy(state, 5)
        row: dict[str, Any] = {
            "size_mib": round(nbytes / MiB),
            "tensors": len(tensors_of(state)),
            **ours,
            **mem,
        }
        if not args.skip_dcp:
            row["dcp_default"] = bench_dcp(state, 3, best=False)
            row["dcp_best"] = bench_dcp(state, 3, best=True)
        row["safe_over_memcpy"] = ours["safe_ms"] / mem["memcpy_ms"]
        row["anon_save_ms"] = anon["save_ms"]
        row["anon_safe_ms"] = anon["safe_ms"]
        row["shm_speed_over_anon"] = anon["safe_ms"] / ours["safe_ms"]
        best = row.get("dcp_best")
        if best:
            row["dcp_best_return_over_save"] = best["return_ms"] / ours["save_ms"]
        row["fg_slowdown_unthrottled"] = foreground_slowdown(state, None)
        row["fg_slowdown_1GBps"] = foreground_slowdown(state, 1_000_000_000)
        row["fg_slowdown_500MBps"] = foreground_slowdown(state, 500_000_000)
        rows.append(row)
        del state

    print(
        f"{'MiB':>6} {'tens':>5} {'save ms':>8} {'safe ms':>8} {'memcpy ms':>9} "
        f"{'safe/memcpy':>11} {'DCP def ret/safe ms':>20} {'DCP best ret/safe ms':>21} "
        f"{'fg x (free/1GB/s/0.5GB/s)':>26}"
    )
    for r in rows:
        d, b = r.get("dcp_default") or {}, r.get("dcp_best") or {}
        print(
            f"{r['size_mib']:>6} {r['tensors']:>5} {r['save_ms']:>8.3f} {r['safe_ms']:>8.1f} "
            f"{r['memcpy_ms']:>9.1f} {r['safe_over_memcpy']:>11.2f} "
            f"{d.get('return_ms', float('nan')):>9.1f}/{d.get('safe_ms', float('nan')):<9.1f} "
            f"{b.get('return_ms', float('nan')):>10.1f}/{b.get('safe_ms', float('nan')):<9.1f} "
            f"{r['fg_slowdown_unthrottled']:>12.2f}/{r['fg_slowdown_1GBps']:.2f}"
            f"/{r['fg_slowdown_500MBps']:.2f}"
        )
    for r in rows:
        print(
            f"{r['size_mib']} MiB: slot CRC-32C on the worker (not in save/maybe_wait) "
            f"{r['crc_ms']:.1f} ms = {r['crc_gb_per_s']:.1f} GB/s; it lengthens the cycle "
            f"the next save() waits for: save() back to back {r['save_back_to_back_ms']:.3f} ms "
            f"vs {r['save_ms']:.3f} ms after steps that outlast the cycle"
        )
        print(
            f"{r['size_mib']} MiB: slots on /dev/shm safe {r['safe_ms']:.1f} ms vs anonymous "
            f"{r['anon_safe_ms']:.1f} ms (speed ratio {r['shm_speed_over_anon']:.2f}); save() "
            f"{r['save_ms']:.3f} vs {r['anon_save_ms']:.3f} ms"
        )
    if len(rows) >= 2:
        print(
            f"save() growth {rows[-1]['size_mib']} MiB vs {rows[0]['size_mib']} MiB: "
            f"{rows[-1]['save_ms'] / rows[0]['save_ms']:.2f}x"
        )
    print_counts(counts)
    print(json.dumps({"benchmark": "capture", "rows": rows, "counts": counts}))


if __name__ == "__main__":
    main()

"""GPU checks that CI (CPU only) cannot run: the CUDA capture path and its timings.

Run on a machine with CUDA: ``PYTHONPATH=src python3 scripts/gpu_check.py``.
Checks (each prints PASS/FAIL) and measurements (printed, plus one JSON line):

1. capture of CUDA tensors is bit-exact, lands in page-locked arenas, and is not
   torn by changes made right after ``maybe_wait()``;
2. a source tensor freed right after ``save()`` is still captured correctly
   (the side stream holds it via ``record_stream``);
3. ``save()`` blocking and time-until-safe for 1 GiB and 4 GiB of GPU state vs
   a raw pinned D2H ``copy_`` of the same bytes and DCP ``async_save`` (default
   and a reused pinned async stager);
4. host arena bytes vs state bytes (the pinned caching allocator's rounding).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture.arena import arena_is_pinned
from lm_resiliency.experimental import InMemoryCheckpointManager

GiB = 1024**3
results: dict[str, Any] = {}
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def gpu_state(nbytes: int) -> dict[str, Any]:
    n_layers = 24
    per = nbytes // (3 * n_layers * 4 * 4)
    model = {f"l{i}.{p}": torch.randn(per, device="cuda") for i in range(n_layers) for p in "abcd"}
    opt = {
        i: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn_like(t),
            "exp_avg_sq": torch.rand_like(t),
        }
        for i, t in enumerate(model.values())
    }
    return {"model": model, "optimizer": {"state": opt, "param_groups": [{"lr": 1e-3}]}}


def flat(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in flat(v)]
    return []


def correctness() -> None:
    state = gpu_state(64 * 1024 * 1024)
    expected = [t.detach().to("cpu", copy=True) for t in flat(state)]
    with InMemoryCheckpointManager(InMemoryCkptConfig(pin_memory=True)) as m:
        m.save(state, 1)
        m.maybe_wait()
        for t in flat(state):
            t.add_(1)  # allowed after maybe_wait
        got = flat(m.load(1))
        pairs = list(zip(got, expected, strict=False))
        bad = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
        detail = ""
        if bad:
            a, b = pairs[bad[0]]
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            detail = f"{len(bad)}/{len(got)} differ; first #{bad[0]} {a.dtype}: max|diff|={diff}"
        check(
            "cuda capture bit-exact and not torn",
            len(got) == len(expected) and not bad,
            f"{len(got)} vs {len(expected)} tensors {detail}",
        )
        check("arena page-locked", arena_is_pinned(m.slots()["own_current"].arena))
        # a temporary freed right after save(): its memory must not be reused before the copy
        tmp = torch.full((32 * 1024 * 1024,), 7.0, device="cuda")
        m.save({"tmp": tmp}, 2)
        del tmp
        junk = torch.full((32 * 1024 * 1024,), -1.0, device="cuda")  # would reuse the freed block
        m.maybe_wait()
        check("freed source captured intact", bool((m.load(2)["tmp"] == 7.0).all()))
        del junk


def timings(nbytes: int) -> dict[str, Any]:
    state = gpu_state(nbytes)
    size = sum(t.numel() * t.element_size() for t in flat(state))
    out: dict[str, Any] = {"bytes": size, "tensors": len(flat(state))}
    save_s, safe_s = [], []
    with InMemoryCheckpointManager(InMemoryCkptConfig(pin_memory=True)) as m:
        for step in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.save(state, step)
            t1 = time.perf_counter()
            m.maybe_wait()
            t2 = time.perf_counter()
            if step >= 2:
                save_s.append(t1 - t0)
                safe_s.append(t2 - t0)
        out["arena_bytes"] = m.arena_bytes()
    out["save_ms"] = statistics.median(save_s) * 1e3
    out["safe_ms"] = statistics.median(safe_s) * 1e3
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    raw = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        raw.append(time.perf_counter() - t0)
    out["raw_d2h_ms"] = statistics.median(raw) * 1e3
    out["safe_over_raw"] = out["safe_ms"] / out["raw_d2h_ms"]
    del src, dst
    try:
        out["dcp"] = dcp_timings(state)
    except Exception as exc:  # report, keep measuring the rest
        out["dcp"] = {"error": repr(exc)[:300]}
    return out


def dcp_timings(nested: dict[str, Any]) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # DCP's natural input: a flat dict of the same tensors (same bytes as ours).
    state = {f"t{i}": t for i, t in enumerate(flat(nested))}
    root = tempfile.mkdtemp(prefix="gpu-dcp-")
    res: dict[str, float] = {}
    try:
        for form in ("default", "best"):
            stager = (
                DefaultStager(StagingOptions(use_shared_memory=False)) if form == "best" else None
            )
            ret, safe = [], []
            for i in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = dcp.async_save(
                    state, checkpoint_id=f"{root}/{form}{i}", async_stager=stager, no_dist=True
                )
                t1 = time.perf_counter()
                if hasattr(r, "staging_completion"):
                    r.staging_completion.result()
                    t2 = time.perf_counter()
                    r.upload_completion.result()
                else:
                    t2 = t1
                    r.result()
                shutil.rmtree(f"{root}/{form}{i}", ignore_errors=True)
                if i:
                    ret.append(t1 - t0)
                    safe.append(t2 - t0)
            if stager is not None:
                stager.close()
            res[f"{form}_return_ms"] = statistics.median(ret) * 1e3
            res[f"{form}_safe_ms"] = statistics.median(safe) * 1e3
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(torch.__version__, torch.cuda.get_device_name())
    correctness()
    for gib in (1, 4):
        r = timings(gib * GiB)
        results[f"{gib}GiB"] = r
        print(json.dumps({f"{gib}GiB": r}))
    print(json.dumps({"gpu_check": results, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""SCOUT on a GPU: what CI (CPU only) cannot run.

Two DDP ranks (Gloo on 127.0.0.1: NCCL refuses two ranks on one GPU) train a
small GPT on the GPU (one GPU: both on ``cuda:0``; more: one each), each on its
own batches. SCOUT checks every step (interval 1), in fp32 and under bf16
autocast. Checks (each
prints PASS/FAIL) and measurements (printed, plus one JSON line):

1. clean phase: every check healthy, no block found non-reproducible (SCOUT
   would stop replaying such a block, so on a GPU whose SDPA backward is not
   deterministic under ``use_deterministic_algorithms`` this FAILs and names the
   block: that is the finding to act on), every block replayed;
2. the replays leave the training's CPU and CUDA generators untouched;
3. a persistent SDC on rank 1 in one transformer layer is reported inconclusive
   (two peers) at the first check that replays that layer, and blocks the capture;
4. the floor on the GPU: each block's bare forward+backward on the replay's
   inputs next to SCOUT's replay of it (ratio), and the check's time.

Run on a CUDA machine: ``PYTHONPATH=src python3 scripts/gpu_scout_check.py``;
``--device cpu`` runs the same checks on the CPU (to validate the script here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_check import check, failures  # the PASS/FAIL printer of the other GPU checks
from scout import bare_pass

from lm_resiliency.detection import Scout, ScoutConfig, ScoutStatus
from lm_resiliency.detection.replay import replay
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT
from lm_resiliency.testing import run_distributed

MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=256, dropout=0.1)
BATCH, SEQ = 8, 64
FAULT_LAYER = 1  # blocks.1


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    torch.cuda.set_device(dev)
    return dev


def _rng(dev: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if dev.type == "cuda":
        states.append(torch.cuda.get_rng_state(dev))
    return states


def _rank(rank: int, world: int, kind: str, dtype: str | None, clean_rounds: int) -> dict[str, Any]:
    dev = _device(kind, rank)
    torch.manual_seed(0)
    net = TinyGPT(MODEL).to(dev)
    ids = [dev.index] if dev.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticTokens(0, BATCH, SEQ, MODEL.vocab_size, rank=rank, world_size=world)
    cast = torch.autocast(dev.type, dtype=getattr(torch, dtype or "float32"), enabled=bool(dtype))
    scout = Scout(ScoutConfig(interval=1), model)
    n_blocks = len(scout.blocks)
    fault_block = next(b.index for b in scout.blocks if b.label == f"blocks.{FAULT_LAYER}")
    onset = clean_rounds * n_blocks + 1
    faults = ComputeFaults(
        [PersistentSDC(rank=1, module=scout.blocks[fault_block].module, from_step=onset)],
        rank=rank,
    )
    faults.arm()
    faults.install(opt)
    rows: list[dict[str, Any]] = []
    rng_untouched = True
    for step in range(1, onset + 2 * n_blocks + 1):
        x, y = (t.to(dev) for t in next(data))
        with cast:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = _rng(dev)
        r = scout.check(step)
        rng_untouched &= all(torch.equal(a, b) for a, b in zip(before, _rng(dev), strict=True))
        rows.append(
            {
                "step": step,
                "status": r.status.value,
                "recipe": r.recipe,
                "faulty": list(r.faulty_ranks),
                "allowed": r.capture_allowed,
                "total_s": r.timings.get("total", 0.0),
                "replay_s": r.timings.get("replay", 0.0),
            }
        )
        if r.status in (ScoutStatus.SDC, ScoutStatus.INCONCLUSIVE):
            break
    disabled = sorted(scout.planner.disabled)
    floor = []
    if scout.recorder is not None:  # rank 0 (the source) has the signatures: local timing
        for b in scout.blocks:
            sig = scout.recorder.signature(b.index)
            if sig is None or b.index == fault_block:
                continue
            bare = [bare_pass(b.module, sig, i) for i in range(12)][2:]
            rep = [replay(b.module, sig, seed=i).seconds for i in range(12)][2:]
            floor.append(
                {
                    "block": b.label,
                    "bare_s": statistics.median(bare),
                    "replay_s": statistics.median(rep),
                }
            )
    faults.remove()
    scout.close()
    return {
        "rows": rows,
        "disabled": [scout.blocks[i].label for i in disabled],
        "rng_untouched": rng_untouched,
        "onset": onset,
        "fault_block": scout.blocks[fault_block].label,
        "blocks": [b.label for b in scout.blocks],
        "floor": floor,
        "sdpa": _sdpa_backend(dev, dtype),
    }


def _sdpa_backend(dev: torch.device, dtype: str | None) -> str:
    if dev.type != "cuda":
        return "cpu"
    cuda = torch.backends.cuda
    flags = {  # the SDPA backends this torch may choose (older builds lack some switches)
        name: getattr(cuda, f"{name}_sdp_enabled", lambda: "n/a")()
        for name in ("flash", "mem_efficient", "cudnn", "math")
    }
    return " ".join(f"{k}={v}" for k, v in flags.items()) + f" dtype={dtype or 'float32'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--clean-rounds", type=int, default=3, help="full rotations before the fault")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device (use --device cpu to validate the script)")
        return 1
    summary: dict[str, Any] = {"device": args.device}
    for dtype in (None, "bfloat16"):
        mode = dtype or "float32"
        t0 = time.perf_counter()
        out = run_distributed(
            _rank, 2, args=(args.device, dtype, args.clean_rounds), timeout_s=900, pg_timeout_s=300
        )
        r0 = out[0]
        print(
            f"[{mode}] {len(r0['rows'])} checks in {time.perf_counter() - t0:.1f} s; {r0['sdpa']}"
        )
        onset = r0["onset"]
        clean = [row for row in r0["rows"] if row["step"] < onset]
        check(
            f"{mode}: clean checks healthy",
            all(row["status"] == "healthy" and row["allowed"] for row in clean),
            f"({len(clean)} checks; statuses {sorted({row['status'] for row in clean})})",
        )
        check(
            f"{mode}: every block reproducible (none disabled)",
            not any(o["disabled"] for o in out),
            f"disabled: {[o['disabled'] for o in out]}",
        )
        replayed = {row["recipe"].split()[0] for row in clean}
        check(
            f"{mode}: every block replayed",
            len(replayed) == len(r0["blocks"]),
            str(sorted(replayed)),
        )
        check(f"{mode}: training RNG untouched", all(o["rng_untouched"] for o in out))
        last = r0["rows"][-1]
        first_after = next(
            (
                row
                for row in r0["rows"]
                if row["step"] >= onset and r0["fault_block"] in row["recipe"]
            ),
            None,
        )
        check(
            f"{mode}: persistent SDC on rank 1 inconclusive at the first check of its block",
            first_after is not None
            and last is first_after
            and last["status"] == "inconclusive"
            and not last["allowed"],
            f"(fault in {r0['fault_block']} from step {onset}; last check {last})",
        )
        floor = r0["floor"]
        bare = statistics.fmean(f["bare_s"] for f in floor) if floor else float("nan")
        rep = statistics.fmean(f["replay_s"] for f in floor) if floor else float("nan")
        totals = [row["total_s"] for row in clean]
        print(
            f"  floor: bare forward+backward {bare * 1e3:.3f} ms mean per block, SCOUT's replay"
            f" {rep * 1e3:.3f} ms (ratio {rep / bare:.2f});"
            f" check {statistics.median(totals) * 1e3:.2f} ms median"
        )
        summary[mode] = {
            "checks": len(r0["rows"]),
            "disabled": [o["disabled"] for o in out],
            "floor_block_s": bare,
            "replay_block_s": rep,
            "check_s_median": statistics.median(totals),
            "per_block": floor,
            "sdpa": r0["sdpa"],
        }
    summary["failures"] = failures
    print(json.dumps(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

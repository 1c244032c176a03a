"""Framework adapters on CPU: blocking time per capture and steps/s with and without GEMINI.

Per framework installed (DeepSpeed ZeRO-2 bf16; Megatron Core's distributed
optimizer and TorchTitan's debug llama3 with FSDP2, both behind their
test-only CPU shims), one torchrun job of 2 Gloo ranks runs
``_framework_worker.py``: warm-up, ``--steps`` plain steps, then resiliency
enabled at interval 10 and ``--steps`` more steps in the same processes.
Reports rank 0's blocking time per capture as the training loop sees it
(adapter ``state_dict`` + ``save`` at the boundary + the wait before the next
step; median and max over the complete capture cycles) and the steps/s
ratio GEMINI/baseline of the same run. Not part of the test suite.

Usage: python benchmarks/frameworks.py [--steps 60] [--frameworks deepspeed megatron torchtitan]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

from lm_resiliency.testing.torchrun import run_torchrun

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
_PACKAGES = {"deepspeed": "deepspeed", "megatron": "megatron.core", "torchtitan": "torchtitan"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _titan_assets(folder: Path) -> Path:
    """A local tokenizer and dataset for TorchTitan (made by the tests' helper)."""
    sys.path.insert(0, str(_REPO / "tests" / "frameworks"))
    import torchtitan_assets

    torchtitan_assets.make(folder / "assets")
    return folder / "assets"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--frameworks", nargs="+", default=list(_PACKAGES))
    args = p.parse_args()
    env = {
        "TORCH_EXTENSIONS_DIR": str(_REPO / ".cache" / "torch_extensions"),
        "PYTHONPATH": str(_REPO / "src"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": tempfile.mkdtemp(prefix="lmr-fw-bench-hf-"),
    }
    rows = []
    for lock in (_REPO / ".cache" / "torch_extensions").glob("*/lock"):
        lock.unlink()  # left by a killed JIT build; torch would wait on it forever
    for fw in args.frameworks:
        if not _installed(_PACKAGES[fw]):
            print(f"{fw}: not installed (make extras); skipped")
            continue
        out = Path(tempfile.mkdtemp(prefix="lmr-fw-bench-")) / "result.json"
        entry = [str(_HERE / "_framework_worker.py"), "--framework", fw, "--out", str(out)]
        entry += ["--steps", str(args.steps), "--interval", str(args.interval)]
        if fw == "torchtitan":
            entry += ["--assets", str(_titan_assets(out.parent))]
        run = run_torchrun(entry, 2, env=env, timeout_s=900)
        if run.returncode != 0:
            print(run.describe(), file=sys.stderr)
            return 1
        res = json.loads(out.read_text())
        cycles = res["blocking_s"]  # complete cycles: launch + the wait before the next step
        res["blocking_median_ms"] = 1e3 * statistics.median(cycles)
        res["blocking_max_ms"] = 1e3 * max(cycles)
        res["blocking_min_ms"] = 1e3 * min(cycles)
        res["launch_median_ms"] = 1e3 * statistics.median(res["launch_s"])
        res["wait_median_ms"] = 1e3 * statistics.median(res["wait_s"])
        res["steps_per_s_ratio"] = res["gemini_steps_per_s"] / res["baseline_steps_per_s"]
        rows.append(res)
    print(
        f"{'framework':<10} {'state/rank':>11} {'captures':>8} {'block med':>10} "
        f"{'block max':>10} {'launch med':>11} {'wait med':>9} {'base st/s':>10} "
        f"{'gemini st/s':>12} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['framework']:<10} {r['state_bytes_per_rank'] / 2**20:>8.1f} MiB "
            f"{len(r['blocking_s']):>8} {r['blocking_median_ms']:>7.2f} ms "
            f"{r['blocking_max_ms']:>7.2f} ms {r['launch_median_ms']:>8.2f} ms "
            f"{r['wait_median_ms']:>6.2f} ms {r['baseline_steps_per_s']:>10.2f} "
            f"{r['gemini_steps_per_s']:>12.2f} {r['steps_per_s_ratio']:>6.3f}"
        )
    print(json.dumps({"benchmark": "frameworks", "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

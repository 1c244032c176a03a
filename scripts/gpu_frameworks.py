"""GPU path of the framework adapters (run by gpu_check.sh with GPU_CHECK_FRAMEWORKS=1).

For DeepSpeed (ZeRO-1/2/3), Megatron Core and TorchTitan, where installed on
the device host: the kill-and-recover job of tests/frameworks on CUDA (NCCL, no
CPU shim) with one rank per visible GPU (at most 2), and a fault-free
reference; the final state must be bit-identical. With a single GPU the rank
recovers from its own node-local files (no peer). TorchTitan needs 2 GPUs (its
adapter refuses a model without FSDP2 sharding, and NCCL does not put two ranks
on one GPU): with one it prints why it is skipped. Prints one line per case;
exit 1 on any mismatch or failed job.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests" / "frameworks"
sys.path.insert(0, str(_TESTS))

from fw_runs import assert_bit_identical, run_job  # noqa: E402


def main() -> int:
    nproc = min(2, torch.cuda.device_count())
    if nproc == 0:
        print("gpu_frameworks: no CUDA device; nothing to check")
        return 1
    cases = []
    if importlib.util.find_spec("deepspeed") is not None:
        cases += [("deepspeed", ["--stage", str(s), "--bf16"]) for s in (1, 2, 3)]
    if importlib.util.find_spec("megatron") is not None:
        cases.append(("megatron", []))
    if importlib.util.find_spec("torchtitan") is not None:
        if nproc >= 2:
            cases.append(("torchtitan", ["--dp-shard", str(nproc)]))
        else:
            print("gpu_frameworks torchtitan: skipped, needs 2 GPUs (FSDP2 over 2 ranks)")
    failed = 0
    for fw, extra in cases:
        tmp = Path(tempfile.mkdtemp(prefix=f"gpu-{fw}-"))
        assets: list[str] = []
        if fw == "torchtitan":
            import torchtitan_assets

            torchtitan_assets.make(tmp / "assets")
            assets = ["--assets", str(tmp / "assets")]
        worker = _TESTS / f"{fw}_worker.py"
        base = ["--cuda", "--steps", "8", "--interval", "3", *extra, *assets]
        fault = ["--fault-step", "7", "--fault-rank", str(nproc - 1)]
        try:
            crash = run_job(worker, tmp, "crash", [*base, *fault], nproc=nproc, max_restarts=1)
            ref = run_job(worker, tmp, "reference", base, nproc=nproc)
            n = assert_bit_identical(crash, ref)
            print(
                f"gpu_frameworks {fw} {' '.join(extra)}: OK, {n} tensors bit-identical, "
                f"resumed at {crash.reports[(1, 0)]['start_step']} "
                f"from {crash.reports[(1, 0)]['sources']}"
            )
        except AssertionError as exc:
            failed += 1
            print(f"gpu_frameworks {fw} {' '.join(extra)}: FAILED\n{exc}")
    if not cases:
        print("gpu_frameworks: none of DeepSpeed, Megatron Core, TorchTitan can run here")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

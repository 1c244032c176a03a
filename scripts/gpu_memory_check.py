"""GPU checks of the memory tier that CI (CPU only) cannot run.

Run on a machine with CUDA: ``PYTHONPATH=src python3 scripts/gpu_memory_check.py``.

1. The manager on an **NCCL default group** (world size 1, one GPU): its
   agreement collectives run on its own CPU Gloo group, so construct, save of
   CUDA tensors, find_latest and load work; the capture is bit-exact.
2. ``cudaHostRegister`` of a memory-tier arena: time per GiB, the arena reports
   pinned, a non-blocking device-to-host copy into it is exact; unregistered at
   release.
3. A **restarted process** re-attaches to the slot file, registers it again and
   recovers the CUDA state bit-exactly from memory.

Prints PASS/FAIL lines and one JSON line; exit status 1 on any FAIL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory import MemoryFolder

GiB = 1 << 30
failures: list[str] = []
results: dict[str, float] = {}


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(3)
    return {"w": torch.randn(64 << 20, device="cuda", generator=g), "step": 5}


def nccl_manager(memory: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(60))
    torch.cuda.set_device(0)
    cfg = InMemoryCkptConfig(run_id="gpu-nccl", memory_folder=memory, disk_flush_interval=0)
    state = _state()
    with InMemoryCheckpointManager(cfg) as m:
        check("control plane is gloo", "gloo" in str(dist.get_backend(m.control.group)).lower())
        m.save(state, 5)
        m.maybe_wait()
        step = m.find_latest()
        got = m.load(step)
        check("nccl default group: find_latest/load", step == 5, f"step={step}")
        check("nccl: bit-exact", torch.equal(got["w"], state["w"].cpu()))
        m.close(finished=False)  # leave the slots for the restarted process below
    dist.destroy_process_group()


def registration(memory: str) -> None:
    folder = MemoryFolder(memory, run_id="gpu-reg", topology="r" * 64, rank=0)
    try:
        for gib in (1, 4):
            file = folder.create("own_0", gib * GiB)
            t0 = time.perf_counter()
            pinned = file.pin()
            dt = time.perf_counter() - t0
            results[f"register_s_per_gib_{gib}"] = dt / gib
            check(f"cudaHostRegister {gib} GiB", pinned and file.arena.is_pinned(), f"{dt:.3f} s")
            src = torch.randn(gib * GiB // 4, device="cuda")
            dst = file.arena.view(torch.float32)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            results[f"d2h_gbps_{gib}"] = gib * GiB / (time.perf_counter() - t0) / 1e9
            check(f"non-blocking D2H into it {gib} GiB", torch.equal(dst, src.cpu()))
            file.remove()  # unregisters before the mapping can go
    finally:
        folder.close()


def restarted(memory: str) -> None:
    code = (
        "import torch, sys\n"
        "from lm_resiliency import InMemoryCkptConfig\n"
        "from lm_resiliency.experimental import InMemoryCheckpointManager\n"
        f"cfg = InMemoryCkptConfig(run_id='gpu-nccl', memory_folder={memory!r})\n"
        "m = InMemoryCheckpointManager(cfg)\n"
        "pinned = [s.arena.is_pinned() for s in m.slots().values() if s.arena is not None\n"
        "          and s.arena.numel()]\n"
        "step = m.find_latest(); got = m.load(step)\n"
        "g = torch.Generator(device='cuda').manual_seed(3)\n"
        "want = torch.randn(64 << 20, device='cuda', generator=g).cpu()\n"
        "print(step, all(pinned) and bool(pinned), m.last_restore.sources[0],\n"
        "      torch.equal(got['w'], want))\n"
        "m.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    check(
        "restarted process: re-attached, re-registered, recovered",
        line == "5 True own memory True",
        line,
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    memory = tempfile.mkdtemp(prefix="lmr-gpu-", dir="/dev/shm")
    try:
        nccl_manager(memory)
        restarted(memory)
        registration(str(Path(memory) / "reg"))
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    print(json.dumps({"benchmark": "gpu_memory_check", **results, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

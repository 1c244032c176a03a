"""Test-side plumbing: run a framework worker under torchrun, read back what it wrote."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lm_resiliency.testing.torchrun import CompletedRun, run_torchrun

REPO = Path(__file__).resolve().parents[2]
# DeepSpeed JIT-compiles its shared-memory op at init_distributed: built once into this
# ignored folder, then loaded from it in every later job (and by CI once per run).
EXTENSIONS_DIR = REPO / ".cache" / "torch_extensions"


def clear_stale_build_locks(root: Path = EXTENSIONS_DIR) -> None:
    """Remove torch's JIT build locks left by a killed job in this checkout's cache.

    torch.utils.cpp_extension holds a lock *file* while it builds or checks an
    extension; a job killed meanwhile leaves it behind and every later job would
    wait on it forever. Call only while no job of this checkout is running.
    """
    for lock in root.glob("*/lock"):
        lock.unlink(missing_ok=True)


@dataclass(frozen=True)
class Job:
    """One finished torchrun job: its output, the per-attempt reports and the final tensors."""

    run: CompletedRun
    reports: dict[tuple[int, int], dict[str, Any]]  # (attempt, rank) -> report
    finals: list[dict[str, torch.Tensor]]  # per rank


def run_job(
    worker: Path,
    tmp: Path,
    name: str,
    args: Sequence[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 240.0,
) -> Job:
    run_dir, disk = tmp / name, tmp / f"{name}-disk"
    run_dir.mkdir(parents=True)
    child_env = {
        "LM_RESILIENCY_RUN_ID": f"{name}-{uuid.uuid4().hex[:8]}",
        "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR),
        "PYTHONPATH": str(REPO / "src"),
        **(env or {}),
    }
    clear_stale_build_locks()
    entry = [str(worker), "--run-dir", str(run_dir), "--disk", str(disk), *args]
    done = run_torchrun(entry, nproc, max_restarts=max_restarts, env=child_env, timeout_s=timeout_s)
    assert done.returncode == 0 and not done.timed_out, done.describe()
    reports = {}
    for path in run_dir.glob("attempt-*-rank-*.json"):
        _, a, _, r = path.stem.split("-")
        reports[(int(a), int(r))] = json.loads(path.read_text())
    finals = [load_file(str(run_dir / f"final-rank-{r}.safetensors")) for r in range(nproc)]
    return Job(done, reports, finals)


def assert_bit_identical(a: Job, b: Job, *, skip: Callable[[int, str], bool] | None = None) -> int:
    """Every final tensor of every rank equal in dtype, shape and bits; returns the count.

    ``skip(rank, key)``: tensors left out of the comparison (say why at the call).
    """
    count = 0
    for rank, (fa, fb) in enumerate(zip(a.finals, b.finals, strict=True)):
        assert sorted(fa) == sorted(fb), (rank, sorted(fa), sorted(fb))
        for key in fa:
            if skip is not None and skip(rank, key):
                continue
            x, y = fa[key], fb[key]
            assert x.dtype == y.dtype and x.shape == y.shape, (rank, key)
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
                f"rank {rank}: {key} differs after recovery"
            )
            count += 1
    return count

"""Start demo jobs under torchrun and compare the final state of two runs bit for bit.

Call order: :func:`start_job` (one torchrun agent, non-blocking; one per
simulated node in multi-node tests) -> ``job.wait(timeout_s)`` -> read the run
folder with :func:`lm_resiliency.demo.events.read_run_events` and
:func:`compare_final`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from lm_resiliency.demo.worker import FINAL_STATE_PREFIX
from lm_resiliency.errors import ConfigError
from lm_resiliency.testing.torchrun import TorchrunJob, start_torchrun

__all__ = ["Comparison", "DemoSpec", "compare_final", "start_job"]

RUN_ID_ENV = "LM_RESILIENCY_RUN_ID"


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """What every worker of one demo job runs (see :mod:`lm_resiliency.demo.worker`)."""

    steps: int = 40
    interval: int = 5
    flush_interval: int = 20
    """Node-local flush cadence in steps (0: only the signal flush writes files)."""
    seed: int = 0
    fault_step: int = 0
    """SIGKILL ``fault_rank`` after this step in the first generation; 0: no fault."""
    fault_rank: int = 1
    hold_step: int = 0
    """Idle in a heartbeat after this step until a peer is lost; 0: never."""
    pg_timeout_s: float = 30.0
    framework: str = "ddp"
    """``"ddp"`` or ``"fsdp2"`` (see :mod:`lm_resiliency.demo.training`)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.interval < 1 or self.flush_interval < 0:
            raise ConfigError(
                f"steps={self.steps}, interval={self.interval} and flush_interval="
                f"{self.flush_interval} must be >= 1, >= 1 and >= 0"
            )
        for name in ("fault_step", "hold_step"):
            value = getattr(self, name)
            if not 0 <= value <= self.steps:
                raise ConfigError(
                    f"{name}={value} is outside the run; use 0 (none) or a step in 1..{self.steps}"
                )

    def worker_args(self, run_dir: Path, disk_folder: Path) -> list[str]:
        """Command-line arguments of :mod:`lm_resiliency.demo.worker`."""
        return [
            "--run-dir", str(run_dir), "--disk-folder", str(disk_folder),
            "--steps", str(self.steps), "--interval", str(self.interval),
            "--flush-interval", str(self.flush_interval), "--seed", str(self.seed),
            "--fault-step", str(self.fault_step), "--fault-rank", str(self.fault_rank),
            "--hold-step", str(self.hold_step), "--pg-timeout-s", str(self.pg_timeout_s),
            "--framework", self.framework,
        ]  # fmt: skip


def start_job(
    spec: DemoSpec,
    run_dir: str | os.PathLike[str],
    disk_folder: str | os.PathLike[str],
    *,
    nproc: int,
    run_id: str,
    max_restarts: int = 1,
    env: Mapping[str, str] | None = None,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    local_addr: str | None = None,
    command_prefix: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
) -> TorchrunJob:
    """Start one torchrun agent with ``nproc`` demo workers; returns at once.

    ``run_id`` becomes ``LM_RESILIENCY_RUN_ID`` (the GEMINI run identity, the
    same on every node and in every generation, so restarted workers find the
    node-local files). Torchrun's logs go to ``workdir`` (default
    ``<run_dir>/torchrun``). The remaining arguments are those of
    :func:`lm_resiliency.testing.torchrun.start_torchrun`.
    """
    run_path, disk_path = Path(run_dir).resolve(), Path(disk_folder).resolve()
    run_path.mkdir(parents=True, exist_ok=True)
    entry = ["-m", "lm_resiliency.demo.worker", *spec.worker_args(run_path, disk_path)]
    return start_torchrun(
        entry,
        nproc,
        max_restarts=max_restarts,
        env={RUN_ID_ENV: run_id, **(env or {})},
        rdzv_endpoint=rdzv_endpoint,
        nnodes=nnodes,
        local_addr=local_addr,
        command_prefix=command_prefix,
        extra_args=extra_args,
        workdir=workdir if workdir is not None else run_path / "torchrun",
    )


@dataclass(frozen=True)
class Comparison:
    """Outcome of :func:`compare_final`: ``identical`` means every tensor is bit-identical."""

    identical: bool
    tensors: int
    mismatched: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0


def load_final(run_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The final parameters and optimizer state every rank of a finished run wrote, by
    ``"rank-<R>/<name>"`` (under FSDP2 each rank's own shards)."""
    paths = sorted(Path(run_dir).glob(f"{FINAL_STATE_PREFIX}*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no final state in {run_dir}: the run did not finish")
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        rank = path.name.removeprefix(FINAL_STATE_PREFIX).removesuffix(".safetensors")
        out.update({f"rank-{rank}/{k}": v for k, v in load_file(str(path)).items()})
    return out


def compare_final(
    run_dir: str | os.PathLike[str], reference_dir: str | os.PathLike[str]
) -> Comparison:
    """Compare two finished runs' final state (every rank's) tensor by tensor with
    ``torch.equal``."""
    got, want = load_final(run_dir), load_final(reference_dir)
    mismatched = sorted(set(got) ^ set(want))
    worst = 0.0
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            mismatched.append(name)
        elif not torch.equal(a, b):
            mismatched.append(name)
            worst = max(worst, float((a.double() - b.double()).abs().max()))
    return Comparison(not mismatched, len(want), mismatched, worst)

"""Worker-side plumbing shared by the framework kill-and-recover workers (run under torchrun).

A worker builds its framework's training objects, calls :func:`enable` (the
resiliency front door for that object), trains with the plain loop, and calls
:func:`maybe_kill` after each step and :func:`finish` at the end. Everything the
test reads comes back as files in ``--run-dir``:

* ``attempt-<a>-rank-<r>.json``: the start step and the recovery report of
  each worker generation (``TORCHELASTIC_RESTART_COUNT`` = a);
* ``final-rank-<r>.safetensors``: the tensors the worker names as its final state.

The kill: in the first generation only, after step ``--fault-step`` every rank
waits until the newest capture is persisted (each rank's own state and the
replica it holds for its peer, in memory and on the rank's own simulated node
folder ``<disk>/node-<r>``), then ``--fault-rank`` deletes its node folder and its
memory slots (its node's storage and memory are gone with it) and SIGKILLs
itself. The restarted group must find the victim's state on its peer's node.
With ``--fault-all`` every rank does so: no GEMINI step survives anywhere and the
restarted group resumes from the framework's durable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.distributed import restart_count


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--disk", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--fault-step", type=int, default=0, help="0: no fault")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument(
        "--fault-all",
        action="store_true",
        help="every rank loses its node folder and memory and SIGKILLs itself: no GEMINI step",
    )
    p.add_argument("--cuda", action="store_true", help="GPU path (scripts/gpu_frameworks.py)")
    return p


def device(args: argparse.Namespace) -> torch.device:
    """This rank's device: its GPU with ``--cuda`` (NCCL), else the CPU (Gloo)."""
    if not args.cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def attempt() -> int:
    return restart_count() or 0


def config(args: argparse.Namespace, rank: int) -> InMemoryCkptConfig:
    """GEMINI settings of the test jobs: every capture persisted on the rank's own node folder."""
    return InMemoryCkptConfig(
        interval=args.interval,
        disk_folder=args.disk / f"node-{rank}",
        disk_flush_interval=args.interval,
        run_id=os.environ["LM_RESILIENCY_RUN_ID"],
        pin_memory=args.cuda,
    )


def report(args: argparse.Namespace, rank: int, **fields: Any) -> None:
    path = args.run_dir / f"attempt-{attempt()}-rank-{rank}.json"
    path.write_text(json.dumps(fields))


def report_recovery(args: argparse.Namespace, rank: int, handle: Any, **extra: Any) -> None:
    """Record what the handle recovered (start step, source, each rank's source)."""
    info = handle.last_recovery
    report(
        args,
        rank,
        start_step=handle.start_step,
        source=info.source,
        sources=list(info.sources) if info.sources else None,
        **extra,
    )


def maybe_kill(args: argparse.Namespace, step: int, rank: int, manager: Any) -> None:
    """The fault (first generation only); see the module doc."""
    if step != args.fault_step or attempt() != 0:
        return
    manager.wait_persisted()
    dist.barrier()
    if rank != args.fault_rank and not args.fault_all:
        return
    if dist.get_world_size() > 1:  # alone, the rank's own files are all there is
        # The rank's node is lost with its memory and its disk: its state can only
        # come back from its peer.
        shutil.rmtree(args.disk / f"node-{rank}", ignore_errors=True)
        if manager.tier is not None:
            shutil.rmtree(manager.tier.folder.path, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def finish(args: argparse.Namespace, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write this rank's final tensors (own storage, contiguous, CPU)."""
    out = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(out, str(args.run_dir / f"final-rank-{rank}.safetensors"))

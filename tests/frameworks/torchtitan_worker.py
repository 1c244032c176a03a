"""TorchTitan training under torchrun with resiliency enabled (see fw_worker for the files).

``python torchtitan_worker.py --run-dir R --disk D --assets A ...``: TorchTitan's
debug llama3 model (random init) on a local tokenizer and dataset (``A``, made
by ``torchtitan_assets.make``), FSDP2 over 2 CPU ranks on Gloo behind the
test-only ``torchtitan_cpu_shim`` (read its doc for exactly what it patches).
The loop is TorchTitan's own ``trainer.train()``. With ``--dcp-interval K``
TorchTitan's DCP checkpointer saves every K steps into ``R/dump/checkpoint``.

Test instrumentation only, as public optimizer hooks on the Trainer's
``OptimizersContainer``: the first step this process trains is recorded, and
the fault of ``fw_worker.maybe_kill`` is injected after ``--fault-step``.

``--candidate-events "3:write:2,5:verified:2,..."`` (first generation only): at the
optimizer pre-hook of step S (after the adapter's own, where SCOUT's pipelined
verdict resolves and calls the adapter's durable-candidate writer) call the writer
(``write``), ``verified`` or ``rejected`` for step N, as SCOUT would. After each,
rank 0 appends to ``candidates-rank-0.json``: the event, TorchTitan's own
discovery (``checkpointer._find_load_step()``, what ``load()`` resumes from) and the
complete DCP folders (``step-*`` and ``scout-candidate-*`` with ``.metadata``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import torchtitan_cpu_shim

if "--cuda" not in sys.argv:
    torchtitan_cpu_shim.install()

import fw_worker
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from lm_resiliency import enable_resiliency
from lm_resiliency.distributed import init_process_group


def build(a: argparse.Namespace) -> Any:
    """The Trainer: debug llama3, FSDP2 (or HSDP) on CPU, TorchTitan's own config knobs."""
    cfg = llama3_debugmodel()
    cfg.hf_assets_path = str(a.assets / "tokenizer")
    cfg.dataloader.dataset_path = str(a.assets / "data")
    cfg.training.seq_len = 32
    cfg.training.local_batch_size = 2
    cfg.training.steps = a.steps
    cfg.training.disable_cuda_graphs = True
    cfg.training.mixed_precision_param = "float32"
    cfg.parallelism.data_parallel_shard_degree = a.dp_shard
    cfg.parallelism.data_parallel_replicate_degree = a.dp_replicate
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.debug.seed = 0  # random init, the same in every job
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1000
    cfg.dump_folder = str(a.run_dir / "dump")
    cfg.checkpoint.enable = a.dcp_interval > 0
    cfg.checkpoint.interval = max(a.dcp_interval, 1)
    trainer = cfg.build()
    if not a.cuda:
        torchtitan_cpu_shim.force_sum_reduction(trainer.model_parts)
    return trainer


def main() -> int:
    p = fw_worker.parser()
    p.add_argument("--assets", type=Path, required=True)
    p.add_argument("--dcp-interval", type=int, default=0, help="0: TorchTitan checkpointing off")
    p.add_argument("--dp-shard", type=int, default=2)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--candidate-events", default="", help="S:action:N,... (see the doc)")
    args = p.parse_args()
    os.environ.setdefault("HF_DATASETS_CACHE", str(args.run_dir / "hf-cache"))
    init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    trainer = build(args)

    # The change a TorchTitan user makes: one call between build and train().
    handle = enable_resiliency(trainer, interval=args.interval, config=fw_worker.config(args, rank))

    info = handle.last_recovery
    fields = {
        "start_step": handle.start_step,
        "source": info.source,
        "sources": list(info.sources) if info.sources else None,
        "trainer_step": int(trainer.step),
        "dcp_steps": _dcp_steps(args.run_dir / "dump" / "checkpoint"),
        "dcp_folders": _dcp_folders(args.run_dir / "dump" / "checkpoint"),
        "replica_ranks": handle.adapter.parallel_layout().replica_ranks,
        "inner": handle.adapter.fsdp.framework,
        "slots": sorted(handle.manager.slots()),
    }
    fw_worker.report(args, rank, **fields)
    first: dict[str, int] = {}

    def record_first(opt: Any, a: Any, k: Any) -> None:
        first.setdefault("step", int(trainer.step))

    def fault(opt: Any, a: Any, k: Any) -> None:
        fw_worker.maybe_kill(args, int(trainer.step), rank, handle.manager)

    trainer.optimizers.register_step_pre_hook(record_first)
    trainer.optimizers.register_step_post_hook(fault)
    if args.candidate_events and fw_worker.attempt() == 0:
        _candidate_events(args, trainer, handle.adapter.durable_candidate(), rank)

    trainer.train()

    handle.manager.wait_persisted()
    fw_worker.report(
        args,
        rank,
        **fields,
        first_step=first.get("step"),
        dataloader=_loader_state(trainer),
    )
    fw_worker.finish(args, rank, _finals(trainer))
    handle.close()
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _dcp_steps(folder: Path) -> list[int]:
    """The steps of TorchTitan's complete DCP checkpoints in ``folder``."""
    done = [p for p in folder.glob("step-*") if (p / ".metadata").is_file()]
    return sorted(int(p.name.split("-")[1]) for p in done)


def _dcp_folders(folder: Path) -> list[str]:
    """The complete DCP checkpoints in ``folder``: TorchTitan's and SCOUT's candidates."""
    return sorted(p.name for p in folder.glob("*") if (p / ".metadata").is_file())


def _candidate_events(args: argparse.Namespace, trainer: Any, writer: Any, rank: int) -> None:
    """Drive the durable-candidate writer as SCOUT would (see the module doc)."""
    events: dict[int, list[tuple[str, int]]] = {}
    for item in args.candidate_events.split(","):
        at, action, step = item.split(":")
        events.setdefault(int(at), []).append((action, int(step)))
    log: list[dict[str, Any]] = []
    folder = args.run_dir / "dump" / "checkpoint"
    calls = {"write": writer, "verified": writer.verified, "rejected": writer.rejected}

    def pre(opt: Any, a: Any, k: Any) -> None:
        for action, step in events.get(int(trainer.step), []):
            calls[action](step)
            if rank == 0:
                found = trainer.checkpointer._find_load_step()
                log.append({"at": int(trainer.step), "event": f"{action} {step}", "load": found})
                log[-1]["folders"] = _dcp_folders(folder)
                (args.run_dir / "candidates-rank-0.json").write_text(json.dumps(log))

    trainer.optimizers.register_step_pre_hook(pre)


def _loader_state(trainer: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader.state_dict(trainer.dataloader)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _finals(t: Any) -> dict[str, torch.Tensor]:
    model = t.model_parts[0]
    final: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        final[f"param.{name}"] = _local(param.detach())
    for i, opt in enumerate(t.optimizers):
        for param, entries in opt.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    final[f"optim.{i}.{names[id(param)]}.{key}"] = _local(value)
        lrs = [float(g["lr"]) for g in opt.param_groups]
        final[f"lr.{i}"] = torch.tensor(lrs, dtype=torch.float64)
    final["last_epoch"] = torch.tensor(t.lr_schedulers.state_dict()["last_epoch"])
    final["step"] = torch.tensor(int(t.step))
    final["ntokens_seen"] = torch.tensor(int(t.ntokens_seen))
    final["rng.default"] = torch.get_rng_state()
    return final


if __name__ == "__main__":
    sys.exit(main())

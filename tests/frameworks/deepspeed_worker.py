"""DeepSpeed ZeRO training under torchrun with resiliency enabled (see fw_worker for the files).

``python deepspeed_worker.py --run-dir R --disk D --stage {1,2,3} [--bf16] ...``

Real DeepSpeed on CPU: ``DS_ACCELERATOR=cpu``, a Gloo group, ``torch_adam``
(no fused-Adam build), a WarmupLR scheduler. The loop is the plain DeepSpeed
loop; batches depend only on (step, rank), so a resumed run sees the batches
an uninterrupted run sees. ``--loader`` feeds it from a real data pipeline
instead: a ``StatefulDataLoader`` over a ``DistributedSampler`` (shuffled),
whose dataset adds augmentation noise from the global torch RNG at each
fetch; the loader is captured through ``state=`` and every rank writes the
sample ids of each step to ``ids-attempt-<a>-rank-<r>.json``.
``--durable-every N`` also saves DeepSpeed's own checkpoint every N steps
(``--durable-dir``), the fallback when GEMINI has no step on every rank.
``--candidate-events "3:write:2,5:verified:2,..."`` enables through the adapter that
owns ``--durable-dir`` (``adapter_for(engine, checkpoint_dir=...)``, ``enable_adapter``:
its fallback and its durable candidates) and, in the first generation only, drives
``adapter.durable_candidate()`` as SCOUT would: at the inner optimizer's
first pre-hook of step S (after the adapter's own, where SCOUT's pipelined verdict
resolves) it writes, verifies or rejects the candidate of step N; rank 0 then
appends the event, the tag ``latest`` names and the tag folders to
``candidates-rank-0.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if "--cuda" not in sys.argv:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
import fw_worker

from lm_resiliency import enable_resiliency
from lm_resiliency.distributed import init_process_group
from lm_resiliency.frontdoor.enable import enable_adapter
from lm_resiliency.integrations.deepspeed import durable_loader
from lm_resiliency.integrations.registry import adapter_for


class NoisyPoints(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Fixed points; each fetch adds noise from the global RNG (a random augmentation)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + 0.1 * torch.randn(16), self.y[i], i


def data_loader(rank: int, world: int, steps: int) -> Any:
    """A ``StatefulDataLoader``: 4 samples per rank and step, one shuffled epoch of ``steps``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = NoisyPoints(4 * world * steps)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    # Its own generator: creating the iterator draws no number from the global RNG.
    gen = torch.Generator().manual_seed(5)
    return StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=gen)


def _tags(folder: Path | None) -> list[str]:
    """The checkpoint tag folders in ``folder``."""
    return (
        []
        if folder is None or not folder.is_dir()
        else sorted(p.name for p in folder.iterdir() if p.is_dir())
    )


def _candidate_events(args: Any, engine: Any, adapter: Any, rank: int) -> None:
    """Drive the adapter's durable-candidate writer as SCOUT would (see the module doc)."""
    writer = adapter.durable_candidate()
    calls = {"write": writer, "verified": writer.verified, "rejected": writer.rejected}
    events: dict[int, list[tuple[str, int]]] = {}
    for item in args.candidate_events.split(","):
        at, action, step = item.split(":")
        events.setdefault(int(at), []).append((action, int(step)))
    log: list[dict[str, Any]] = []

    def pre(opt: Any, a: Any, k: Any) -> None:
        at = int(engine.global_steps) + 1  # the step being taken
        for action, step in events.pop(at, []):  # once per step: the first inner call
            calls[action](step)
            if rank == 0:
                log.append({"at": at, "event": f"{action} {step}", "latest": writer.latest()})
                log[-1]["tags"] = _tags(args.durable_dir)
                (args.run_dir / "candidates-rank-0.json").write_text(json.dumps(log))

    adapter.view.inner.register_step_pre_hook(pre)


def main() -> int:
    p = fw_worker.parser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--durable-dir", type=Path, default=None)
    p.add_argument("--durable-every", type=int, default=0)
    p.add_argument("--loader", action="store_true", help="a real DataLoader (see the doc)")
    p.add_argument("--candidate-events", default="", help="S:action:N,... (see the doc)")
    args = p.parse_args()
    backend = "nccl" if args.cuda else "gloo"
    dev = fw_worker.device(args)
    init_process_group(backend)
    deepspeed.init_distributed(dist_backend=backend)  # wraps the group formed above
    rank = dist.get_rank()
    torch.manual_seed(0)
    # BatchNorm: its running statistics are module buffers, outside the optimizer's
    # partitions; a restore that left them out would not finish bit-identical. Not in
    # bf16: DeepSpeed's bf16 engine on CPU fails in batch_norm (mixed Float/BFloat16).
    norm = torch.nn.Identity() if args.bf16 else torch.nn.BatchNorm1d(32)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        norm,
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.Linear(32, 4),
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10_000,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    fallback = None if args.durable_dir is None else durable_loader(engine, args.durable_dir)
    loader = data_loader(rank, dist.get_world_size(), args.steps) if args.loader else None
    torch.manual_seed(1 + rank)  # the augmentation noise differs per rank
    state = None if loader is None else {"loader": loader}
    if args.candidate_events:
        adapter = adapter_for(engine, checkpoint_dir=args.durable_dir)
        handle = enable_adapter(adapter, config=fw_worker.config(args, rank), state=state)
    else:
        handle = enable_resiliency(
            engine,
            interval=args.interval,
            config=fw_worker.config(args, rank),
            load_fallback=fallback,
            state=state,
        )
    tags = _tags(args.durable_dir)
    fw_worker.report_recovery(args, rank, handle, global_steps=int(engine.global_steps), tags=tags)
    if args.candidate_events and fw_worker.attempt() == 0:
        _candidate_events(args, engine, handle.adapter, rank)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    batches = None if loader is None else iter(loader)
    consumed: list[list[int]] = []
    for step in range(handle.start_step + 1, args.steps + 1):
        if batches is None:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(4, 16, generator=g).to(dev, dtype)
            y = torch.randn(4, 4, generator=g).to(dev)
        else:
            x, y, ids = next(batches)
            x, y = x.to(dev, dtype), y.to(dev)
            consumed.append([step, *ids.tolist()])
            ids_file = args.run_dir / f"ids-attempt-{fw_worker.attempt()}-rank-{rank}.json"
            ids_file.write_text(json.dumps(consumed))
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if args.durable_every and step % args.durable_every == 0:
            engine.save_checkpoint(str(args.durable_dir), tag=f"step{step}")
        fw_worker.maybe_kill(args, step, rank, handle.manager)
    handle.manager.wait_persisted()
    view = handle.adapter.view
    final = {f"master.{i}": m for i, m in enumerate(view.masters)}
    for i, st in enumerate(view.inner.state[m] for m in view.masters):
        final.update({f"optim.{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    for name, param in engine.module.named_parameters():
        final[f"param.{name}"] = param.ds_tensor if hasattr(param, "ds_tensor") else param
    final.update({f"buffer.{n}": b for n, b in engine.module.named_buffers()})
    final["lr"] = torch.tensor(engine.get_lr(), dtype=torch.float64)
    final["global_steps"] = torch.tensor(engine.global_steps)
    fw_worker.finish(args, rank, final)
    handle.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

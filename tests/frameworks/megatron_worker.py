"""Megatron Core training under torchrun with resiliency enabled (see fw_worker for the files).

``python megatron_worker.py --run-dir R --disk D ...``: the setup of
``megatron_build`` (a 2-layer GPTModel with dropout, so the CUDA RNG tracker
matters; Megatron's DDP, the distributed optimizer, an OptimizerParamScheduler),
data parallel over 2 ranks on Gloo. CPU only through the test-only
``megatron_cpu_shim`` (read its doc for exactly what it patches). Batches
depend only on (step, rank). The loop is Megatron Core's plain training step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import megatron_cpu_shim

if "--cuda" not in sys.argv:
    megatron_cpu_shim.install()

import fw_worker
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_build import build, train_step

from lm_resiliency import enable_resiliency
from lm_resiliency.distributed import init_process_group


def main() -> int:
    args = fw_worker.parser().parse_args()
    dev = fw_worker.device(args)
    init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    m = build(steps=args.steps, device=dev)
    chunk, optimizer, scheduler = m.chunk, m.optimizer, m.scheduler
    # The three-line change: the registry recognises the chunk list and hands Megatron's
    # own optimizer to its adapter; the scheduler is one of the captured state objects.
    handle = enable_resiliency(
        [chunk],
        optimizer,
        interval=args.interval,
        config=fw_worker.config(args, rank),
        state={"scheduler": scheduler},
    )
    fw_worker.report_recovery(args, rank, handle, scheduler_steps=int(scheduler.num_steps))
    for step in range(handle.start_step + 1, args.steps + 1):
        train_step(m, step, rank, dev)
        fw_worker.maybe_kill(args, step, rank, handle.manager)
    handle.manager.wait_persisted()
    final: dict[str, torch.Tensor] = {}
    for i, part in enumerate(handle.adapter.parts):
        for j, master in enumerate(part.masters):
            final[f"master.{i}.{j}"] = master
            st = part.inner.state[master]
            final.update({f"optim.{i}.{j}.{k}": v for k, v in st.items()})
    for name, param in chunk.named_parameters():
        final[f"param.{name}"] = param
    for name, buf in torch.nn.Module.named_buffers(chunk):  # Megatron's DDP shadows .buffers
        final[f"buffer.{name}"] = buf
    for name, state in get_cuda_rng_tracker().get_states().items():
        final[f"rng.{name}"] = state
    final["rng.default"] = torch.get_rng_state()
    final["lr"] = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    final["scheduler_steps"] = torch.tensor(scheduler.num_steps)
    fw_worker.finish(args, rank, final)
    handle.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

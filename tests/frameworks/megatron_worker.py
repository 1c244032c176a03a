"""Megatron Core training under torchrun with resiliency enabled (see fw_worker for the files).

``python megatron_worker.py --run-dir R --disk D ...``: a 2-layer GPTModel with
dropout (so the CUDA RNG tracker matters), Megatron's DDP, the distributed
optimizer (Adam) and an ``OptimizerParamScheduler`` (warmup + cosine), data
parallel over 2 ranks on Gloo. CPU only through the test-only
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
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer import TransformerConfig

from lm_resiliency import enable_resiliency
from lm_resiliency.distributed import init_process_group

_VOCAB, _SEQ, _BATCH = 64, 8, 2


def main() -> int:
    args = fw_worker.parser().parse_args()
    dev = fw_worker.device(args)
    init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=_VOCAB, max_sequence_length=_SEQ
    )
    model.to(dev)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    chunk = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, use_distributed_optimizer=True
    )
    optimizer = get_megatron_optimizer(opt_config, [chunk])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=args.steps,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
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
    positions = torch.arange(_SEQ, device=dev).unsqueeze(0).expand(_BATCH, _SEQ)
    for step in range(handle.start_step + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=g).to(dev)
        labels = torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=g).to(dev)
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = chunk(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([chunk])
        optimizer.step()
        scheduler.step(increment=1)
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

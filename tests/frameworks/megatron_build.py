"""The tiny Megatron Core training setup the framework tests share (model, DDP, optimizer, LR).

``build(...)`` needs ``torch.distributed`` initialized and, on a CPU-only
machine, the test-only ``megatron_cpu_shim`` installed first (its doc lists
what it patches). It initializes Megatron's model-parallel state with the
given tensor-parallel size (the rest of the world is data parallel), then
builds a 2-layer ``GPTModel`` with dropout, Megatron's DDP, the distributed
optimizer (Adam) and an ``OptimizerParamScheduler`` (warmup + cosine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
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
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

VOCAB, SEQ, BATCH = 64, 8, 2


@dataclass(frozen=True)
class Megatron:
    """One rank's training objects, as a Megatron Core loop holds them."""

    chunk: DistributedDataParallel
    optimizer: Any  # what get_megatron_optimizer returns (not a torch optimizer)
    scheduler: OptimizerParamScheduler


def build(
    *, steps: int, device: torch.device | str = "cpu", tp: int = 1, hidden: int = 16
) -> Megatron:
    """Initialize model parallelism with ``tp`` and build the objects; same seeds every call."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model.to(device)
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
        lr_decay_steps=steps,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return Megatron(chunk, optimizer, scheduler)


def train_step(m: Megatron, step: int, rank: int, device: torch.device | str = "cpu") -> None:
    """Megatron Core's plain step on a batch that depends only on (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, SEQ)
    m.chunk.zero_grad_buffer()
    m.optimizer.zero_grad()
    loss = m.chunk(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([m.chunk])
    m.optimizer.step()
    m.scheduler.step(increment=1)

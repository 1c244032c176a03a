"""What the torchrun loop workers share: the model, the loss, the entry point, the final dump.

Imported by ``plain_loop.py`` and ``mtgs_loop.py`` both when torchrun runs them as
scripts and when a test imports them as ``workers.<name>`` (each puts this folder
on ``sys.path`` first).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.distributed import init_process_group
from lm_resiliency.models import GPTConfig

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    loss: torch.Tensor = model(inputs, targets)
    return loss


def main(train: Callable[[list[str]], None]) -> int:
    """torchrun entry: one CPU thread, a Gloo group, ``train(argv)``, teardown."""
    torch.set_num_threads(1)
    init_process_group("gloo")
    train(sys.argv[1:])
    dist.destroy_process_group()
    return 0


def save_final(out: Path, rank: int, ddp_model: DDP, optimizer: torch.optim.Optimizer) -> None:
    """The rank's final parameters and optimizer state, to ``out/final-rank<R>.safetensors``."""
    final = {f"param/{n}": t.detach().clone() for n, t in ddp_model.module.named_parameters()}
    names = {id(t): n for n, t in ddp_model.module.named_parameters()}
    for param, st in optimizer.state.items():
        for key, value in st.items():
            final[f"optim/{names[id(param)]}/{key}"] = value.detach().clone().reshape(-1)
    save_file(final, str(out / f"final-rank{rank}.safetensors"))

"""The small FSDP2 model the FSDP2/HSDP tests share (every parameterised layer sharded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


def sharded_mlp(mesh: Any) -> nn.Module:
    """Embedding, Linear, GELU, Dropout, Linear; each layer and the root ``fully_shard``ed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(32, 16),
        nn.Flatten(),
        nn.Linear(16 * 8, 40),  # 40 rows: uneven shards on 3+ ranks are covered too
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(40, 32 * 8),
    )
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

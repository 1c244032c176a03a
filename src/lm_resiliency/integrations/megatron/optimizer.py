"""Where Megatron Core's distributed optimizer keeps a rank's unique state; what is derived.

``get_megatron_optimizer(..., use_distributed_optimizer=True)`` returns a
``ChainedOptimizer`` of ``DistributedOptimizer`` s (one per param-group kind),
or a single one. Each wraps a plain torch optimizer whose param groups hold
this rank's *main-param shards*: fp32 shards of the model's flat param buffer
(views of it for fp32 params, separate fp32 copies for bf16/fp16 params). The
shards and their optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``) are
what no other data-parallel rank holds.

Re-derived on restore (Megatron 0.16): the low-precision model params from the
shards (``_copy_main_params_to_model_params``, what ``step()`` itself calls), then
the full params on every rank by the param all-gather of each model chunk
(``start_param_sync(force_sync=True)``, collective over the data-parallel group).

The classes are matched by name, so importing this module needs no Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import ConfigError

__all__ = ["ShardedOptimizer", "sharded_optimizers"]


@dataclass(frozen=True)
class ShardedOptimizer:
    """One ``DistributedOptimizer``: its inner torch optimizer and main-param shards, in order."""

    dist_opt: Any
    inner: torch.optim.Optimizer
    masters: tuple[torch.Tensor, ...]

    def copy_masters_to_model(self) -> None:
        self.dist_opt._copy_main_params_to_model_params()


def _names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def sharded_optimizers(optimizer: Any) -> list[ShardedOptimizer]:
    """The distributed optimizers inside ``optimizer``; ``ConfigError`` for anything else."""
    parts = (
        list(optimizer.chained_optimizers)
        if "ChainedOptimizer" in _names(optimizer)
        else [optimizer]
    )
    found = []
    for part in parts:
        if "DistributedOptimizer" not in _names(part):
            raise ConfigError(
                f"the Megatron optimizer is (or chains) a {type(part).__name__}; the resiliency "
                "adapter supports the distributed optimizer: build it with "
                "OptimizerConfig(use_distributed_optimizer=True)"
            )
        if getattr(part, "grad_scaler", None) is not None:
            raise ConfigError(
                "Megatron fp16 with a grad scaler is not supported by the resiliency adapter "
                "(its scaler state is not captured); use bf16 or fp32"
            )
        inner = part.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                f"the distributed optimizer wraps a {type(inner).__name__}, not a "
                "torch.optim.Optimizer; use optimizer='adam' or 'sgd' without CPU offload"
            )
        masters = tuple(p for group in inner.param_groups for p in group["params"])
        found.append(ShardedOptimizer(part, inner, masters))
    return found


def model_chunks(model: Any) -> Sequence[torch.nn.Module]:
    """One model chunk or a list of them (virtual pipeline stages), as a list."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise ConfigError(
                f"Megatron model chunks must be torch modules, got {type(chunk).__name__}; "
                "pass the list the model provider returned (wrapped in Megatron's DDP)"
            )
    return chunks

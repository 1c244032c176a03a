"""Find the adapter for what the user passed to ``enable_resiliency``.

Detection is by type only, and a framework's adapter module (and with it the
framework) is imported only when the object's class hierarchy names that
framework: ``enable_resiliency(model)`` on a plain PyTorch model never imports
``transformers`` or ``deepspeed``.

Adding a framework: append a :class:`Rule` to ``RULES`` naming the package
prefix and class name to look for in ``type(obj).__mro__`` and the adapter
module; that module defines ``make_adapter(obj, optimizers, **options) ->
Adapter``. Rules are tried in order; the torch rules (FSDP2, DDP, plain
module) come last because framework objects often *contain* torch modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import Adapter

try:
    from torch.distributed.fsdp import FullyShardedDataParallel
except ImportError:  # torch without FSDP
    FullyShardedDataParallel = None  # type: ignore[assignment,misc]
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch without FSDP2
    FSDPModule = None  # type: ignore[assignment,misc]

__all__ = ["RULES", "Rule", "adapter_for", "as_optimizers"]


@dataclass(frozen=True)
class Rule:
    """``obj`` matches when a class in its MRO lives under ``package`` and is named ``name``."""

    package: str
    name: str
    adapter_module: str

    def matches(self, obj: object) -> bool:
        for cls in type(obj).__mro__:
            module = getattr(cls, "__module__", "") or ""
            if cls.__name__ == self.name and (
                module == self.package or module.startswith(self.package + ".")
            ):
                return True
        return False


RULES: list[Rule] = [
    Rule("transformers", "Trainer", "lm_resiliency.integrations.hf"),
    Rule("deepspeed", "DeepSpeedEngine", "lm_resiliency.integrations.deepspeed"),
    Rule("megatron", "MegatronModule", "lm_resiliency.integrations.megatron"),
    Rule("torchtitan", "Trainer", "lm_resiliency.integrations.torchtitan"),
]
"""Framework rules, tried before the torch ones (see the module doc)."""


def _as_list(optimizer: Any) -> list[Any]:
    return list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]


def as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``None``, one optimizer or a sequence of them, as a list; raises ``ConfigError``."""
    if optimizer is None:
        return []
    items = _as_list(optimizer)
    for item in items:
        if not isinstance(item, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer (or a list of them), got "
                f"{type(item).__name__}; pass the optimizer whose step() ends a training step"
            )
    return items


def adapter_for(obj: Any, optimizer: Any = None, **options: Any) -> Adapter:
    """The adapter for ``obj`` (a model, an engine, a trainer, or a list of model chunks)
    and its optimizer(s).

    A framework's own optimizer (Megatron's distributed optimizer, which is not
    a ``torch.optim.Optimizer``) is handed to its adapter as given; a list of
    model chunks is matched by its first chunk. Local (no collectives). Raises
    ``ConfigError`` when nothing fits or the framework's adapter is not
    installed, naming the type and what is supported.
    """
    probe = obj[0] if isinstance(obj, (list, tuple)) and obj else obj
    for rule in RULES:
        if rule.matches(probe):
            try:
                module = importlib.import_module(rule.adapter_module)
            except ImportError as exc:
                raise ConfigError(
                    f"{type(obj).__name__} is a {rule.package} object but its adapter "
                    f"{rule.adapter_module} cannot be imported ({exc}); install the "
                    f"framework and lm-resiliency's extra for it"
                ) from exc
            given = [] if optimizer is None else _as_list(optimizer)
            adapter: Adapter = module.make_adapter(obj, given, **options)
            return adapter
    optimizers = as_optimizers(optimizer)
    if isinstance(obj, torch.nn.Module):
        return _torch_adapter(obj, optimizers, **options)
    raise ConfigError(
        f"enable_resiliency does not know {type(obj).__module__}.{type(obj).__qualname__}; "
        "pass a torch.nn.Module (plain, DistributedDataParallel or fully_shard-ed), a "
        "transformers.Trainer, or build an Adapter (lm_resiliency.integrations.base)"
    )


def _torch_adapter(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], **options: Any
) -> Adapter:
    _reject_fsdp1(model)
    if _is_fully_sharded(model):
        name = "lm_resiliency.integrations.fsdp"
    elif isinstance(model, DistributedDataParallel):
        name = "lm_resiliency.integrations.ddp"
    else:
        name = "lm_resiliency.integrations.module"
    adapter: Adapter = importlib.import_module(name).make_adapter(model, optimizers, **options)
    return adapter


def _reject_fsdp1(model: torch.nn.Module) -> None:
    if FullyShardedDataParallel is None:  # torch without FSDP
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError(
            "FullyShardedDataParallel (FSDP1) is not supported by enable_resiliency: its "
            "state_dict() gathers across ranks inside the capture; shard the model with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead"
        )


def _is_fully_sharded(model: torch.nn.Module) -> bool:
    if FSDPModule is None:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())

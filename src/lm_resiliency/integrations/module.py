"""Adapter for a plain ``torch.nn.Module`` (one process, or ranks that sync by themselves).

The recovery state is the module's ``state_dict()`` (parameters and buffers)
and each optimizer's ``state_dict()``; both only reference the live tensors,
which the capture copies before the next step changes them, except the
buffers, which the next forward changes: they are copied at the boundary
(:mod:`lm_resiliency.capture.buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.capture.buffers import snapshot_buffers
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import AdapterBase

__all__ = ["ModuleAdapter", "make_adapter"]


class ModuleAdapter(AdapterBase):
    """``model`` and the optimizers whose ``step()`` ends a training step."""

    framework = "torch"

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().__init__(optimizers)
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        model = self.model.state_dict()
        snapshot_buffers(self.model, model)  # a forward changes them in place
        return {
            "model": model,
            "optimizers": [o.state_dict() for o in self._optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self._optimizers):
            raise ConfigError(
                f"the checkpoint holds {len(saved)} optimizer state(s) but "
                f"{len(self._optimizers)} optimizer(s) were given; pass the same optimizers "
                "to enable_resiliency as the run that wrote it"
            )
        self.model.load_state_dict(state["model"])
        for opt, opt_state in zip(self._optimizers, saved, strict=True):
            opt.load_state_dict(opt_state)

    def modules(self) -> Sequence[torch.nn.Module]:
        return [self.model]


def make_adapter(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], **options: Any
) -> ModuleAdapter:
    """The registry's factory; ``options`` must be empty for a plain module."""
    if options:
        raise ConfigError(f"a plain module adapter takes no options, got {sorted(options)}")
    return ModuleAdapter(model, optimizers)

"""Adapter for a plain ``torch.nn.Module`` (one process, or ranks that sync by themselves).

The recovery state is the module's ``state_dict()`` (parameters and buffers)
and each optimizer's ``state_dict()``; both only reference the live tensors,
which the capture copies before the next step changes them, except the
buffers, which the next forward changes: they are copied at the boundary
(:mod:`lm_resiliency.capture.buffers`).

At a capture boundary (:meth:`ModuleAdapter.capture_state`) the training thread
takes only what the next steps' work changes before ``optimizer.step()``: the
buffer copies and each optimizer's param-group hyperparameters (an LR scheduler
steps right after the optimizer). ``model.state_dict()`` and
``optimizer.state_dict()`` (one entry per tensor) run on the capture worker,
before its copy and so before the next ``optimizer.step()`` can change what they
read, with those values put back in. Nothing per parameter runs on the training
thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from lm_resiliency.capture.buffers import BoundaryBuffers, snapshot_buffers
from lm_resiliency.errors import CaptureError, ConfigError
from lm_resiliency.integrations.base import AdapterBase
from lm_resiliency.state import Deferred

__all__ = ["ModuleAdapter", "make_adapter"]


class ModuleAdapter(AdapterBase):
    """``model`` and the optimizers whose ``step()`` ends a training step."""

    framework = "torch"

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().__init__(optimizers)
        self.model = model
        self._buffers = BoundaryBuffers(model, every_path=True)

    def state_dict(self) -> dict[str, Any]:
        model = self.model.state_dict()
        snapshot_buffers(self.model, model)  # a forward changes them in place
        return {
            "model": model,
            "optimizers": [o.state_dict() for o in self._optimizers],
        }

    def capture_state(self) -> dict[str, Any]:
        """:meth:`state_dict` with its per-tensor work left to the capture worker (module doc)."""
        buffers = self._buffers.copies()  # a forward changes them in place
        return {
            "model": Deferred(partial(_model_state, self.model, buffers)),
            "optimizers": [
                Deferred(partial(_optimizer_state, i, o, _hyperparameters(o)))
                for i, o in enumerate(self._optimizers)
            ],
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


_Groups = list[tuple[int, dict[str, Any]]]


def _hyperparameters(opt: torch.optim.Optimizer) -> _Groups:
    """Each param group's size and values but ``params``, as they are now (tensors copied)."""
    return [
        (
            len(g["params"]),
            {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in g.items()
                if k != "params"
            },
        )
        for g in opt.param_groups
    ]


def _model_state(model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> Any:
    """Capture worker: ``model.state_dict()`` with the boundary's buffer copies in it."""
    state = model.state_dict()
    for name, value in buffers.items():
        if name in state:
            state[name] = value
    return state


def _optimizer_state(index: int, opt: torch.optim.Optimizer, groups: _Groups) -> Any:
    """Capture worker: ``opt.state_dict()`` with the boundary's hyperparameters in its groups."""
    state = opt.state_dict()
    saved = state["param_groups"]
    if [len(g["params"]) for g in saved] != [n for n, _ in groups]:
        raise CaptureError(
            f"optimizer {index}: its param groups changed between the capture boundary and the "
            f"capture's copy ({[n for n, _ in groups]} -> {[len(g['params']) for g in saved]} "
            "parameters per group); call add_param_group() before a step's optimizer.step(), "
            "not between it and the next one"
        )
    for group, (_, values) in zip(saved, groups, strict=True):
        group.update(values)
    return state

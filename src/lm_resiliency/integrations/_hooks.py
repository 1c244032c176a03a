"""The default step boundary: public ``torch.optim.Optimizer`` step hooks.

``register_step_pre_hook`` runs before an optimizer modifies its parameters,
``register_step_post_hook`` right after; both are per-instance public API, so
nothing of torch is patched. With several optimizers the boundary is reached
when each of them stepped once since the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import StepBoundary, Unbind


def bind_optimizer_hooks(
    optimizers: Sequence[torch.optim.Optimizer], boundary: StepBoundary
) -> Unbind:
    """Install the hooks; returns the function that removes them. Raises ``ConfigError``."""
    if not optimizers:
        raise ConfigError(
            "no optimizer to hook: pass the optimizer, e.g. enable_resiliency(model, optimizer)"
        )
    ids = [id(o) for o in optimizers]
    if len(set(ids)) != len(ids):
        raise ConfigError("the same optimizer was given twice; pass each optimizer once")
    pending: set[int] = set()

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        boundary.before_step()

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending.add(id(opt))
        if len(pending) == len(ids):
            pending.clear()
            boundary.after_step()

    handles = []
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))

    def unbind() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    return unbind

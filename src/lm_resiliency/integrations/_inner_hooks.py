"""The step boundary of a framework optimizer that wraps a torch one and finishes later.

DeepSpeed's ZeRO optimizers and Megatron's optimizers are not torch optimizers:
inside one training step they call a wrapped ``torch.optim.Optimizer`` once per
param group or sub-group, and only *after* those calls does the step finish:
DeepSpeed's engine then advances its LR scheduler and step counters, the user
of Megatron Core calls ``scheduler.step()``. State captured right after the
inner optimizer would mix the new parameters with the old scheduler.

So the boundary is split over public per-instance torch hooks, nothing patched:

* ``before_step`` from the inner optimizer's step *pre*-hook, before its first
  call of a step (nothing is modified before it);
* ``optimizer_done`` from the post-hook of its last call of a step: the
  parameters are final, and the training loop has not fetched the next batch
  yet, so the RNGs and the caller's ``state`` objects (a data loader's
  position) are taken there;
* ``after_step`` once the step is complete: at the next forward pre-hook of the
  training modules (the next step's forward, or an evaluation forward), or at
  the inner optimizer's next step, or when the hooks are removed, whichever is
  first. The parameters, optimizer state, scheduler and counters are then all
  those of the finished step, and the copy overlaps the next forward/backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import StepBoundary, Unbind

__all__ = ["bind_deferred_steps"]


def bind_deferred_steps(
    inners: Sequence[torch.optim.Optimizer],
    calls_per_step: int,
    modules: Sequence[torch.nn.Module],
    boundary: StepBoundary,
) -> Unbind:
    """Hook ``inner`` and ``modules`` as described in the module doc; returns the remover.

    ``calls_per_step``: how many ``step()`` calls of the ``inners`` together make
    one training step (Megatron's chained optimizers step each inner once).
    Removing the hooks first delivers a pending ``after_step`` (the last step of
    a run is counted and captured). Raises ``ConfigError`` for a non-positive
    ``calls_per_step`` or no module.
    """
    if calls_per_step < 1:
        raise ConfigError(
            f"calls_per_step={calls_per_step}: the framework optimizer steps no torch "
            "optimizer; nothing marks the step boundary"
        )
    if not modules:
        raise ConfigError("no training module to detect the end of a step on")
    calls = [0]
    pending = [False]

    def deliver() -> None:
        if pending[0]:
            pending[0] = False
            boundary.after_step()

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if calls[0] == 0:
            deliver()
            boundary.before_step()

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == calls_per_step:
            calls[0] = 0
            pending[0] = True
            boundary.optimizer_done()

    def forward_pre(module: torch.nn.Module, args: Any) -> None:
        deliver()

    handles = [o.register_step_pre_hook(pre) for o in inners]
    handles += [o.register_step_post_hook(post) for o in inners]
    handles += [m.register_forward_pre_hook(forward_pre) for m in modules]

    def unbind() -> None:
        try:
            deliver()
        finally:
            for h in handles:
                h.remove()
            handles.clear()

    return unbind

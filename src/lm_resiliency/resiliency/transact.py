"""Composition of GEMINI with MTGS: each step a transaction, only committed steps captured.

How the two fit (no hook of one knows the other):

* MTGS runs ``optimizer.step()`` itself, inside the commit. The handle's
  pre-step hook on that optimizer still fires there, so the capture in flight
  is complete before MTGS modifies the parameters.
* The post-step hook does nothing under MTGS (:class:`~lm_resiliency.resiliency.boundary.WaitOnly`):
  ``optimizer.step()`` of an attempt is not yet a committed step (the commit
  confirmation may still roll it back). :meth:`ResiliencyHandle.train_step`
  counts the step and launches the capture only after MTGS returned a
  committed result, so an aborted and retried attempt is never captured.
* An LR scheduler and a ``GradScaler`` found in ``state`` are handed to MTGS:
  the transaction steps them on commit (and restores them on rollback), so
  their captured state is the committed one. The other ``state`` objects are
  MTGS's data state: restored before every retry, so a closure that draws its
  own batch gets the same batch again.
"""

from __future__ import annotations

from typing import Any

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import Adapter
from lm_resiliency.resiliency.objects import StateObjects, is_grad_scaler, is_lr_scheduler
from lm_resiliency.transactions import MTGS, MTGSConfig

__all__ = ["build_mtgs"]


class _DataState:
    """MTGS's data state over several ``state`` objects."""

    def __init__(self, objects: StateObjects) -> None:
        self._objects = objects

    def state_dict(self) -> dict[str, Any]:
        return self._objects.state_dicts()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._objects.load(state)


def build_mtgs(
    adapter: Adapter, objects: StateObjects, config: MTGSConfig, *, committed_steps: int
) -> MTGS:
    """The step transaction for a DDP adapter; raises ``ConfigError`` for ambiguous state."""
    ddp = getattr(adapter, "ddp", None)
    if ddp is None:
        raise ConfigError("MTGS needs the DDP adapter (enable_resiliency validates this)")
    schedulers = [n for n, o in objects.items() if is_lr_scheduler(o)]
    scalers = [n for n, o in objects.items() if is_grad_scaler(o)]
    for kind, names in (("LR scheduler", schedulers), ("GradScaler", scalers)):
        if len(names) > 1:
            raise ConfigError(
                f"state holds {len(names)} {kind}s ({names}); with mtgs=... the transaction "
                f"steps one {kind}; pass at most one"
            )
    owned = {*schedulers, *scalers}
    data = objects.without(owned)
    by_name = dict(objects.items())
    return MTGS(
        ddp,
        adapter.step_optimizers()[0],
        by_name[schedulers[0]] if schedulers else None,
        config=config,
        scaler=by_name[scalers[0]] if scalers else None,
        data_state=_DataState(data) if len(data) else None,
        committed_steps=committed_steps,
    )

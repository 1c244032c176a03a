"""Composition of GEMINI with MTGS: each step a transaction, only committed steps captured.

How the two fit (no hook of one knows the other):

* MTGS runs ``optimizer.step()`` itself, inside the commit. The handle's
  pre-step hook on that optimizer still fires there, so the capture in flight
  is complete before MTGS modifies the parameters.
* The post-step hook does nothing under MTGS (:class:`~lm_resiliency.frontdoor.boundary.WaitOnly`):
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

import torch.distributed as dist

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import FaultInjector
from lm_resiliency.frontdoor.objects import StateObjects, is_grad_scaler, is_lr_scheduler
from lm_resiliency.integrations.base import Adapter
from lm_resiliency.transactions import MTGS, MTGSConfig
from lm_resiliency.transactions.reducer import Reducer
from lm_resiliency.transactions.transaction import Stateful

__all__ = ["attach_faults", "build_mtgs", "check_faults"]


class _DataState:
    """MTGS's data state over several ``state`` objects, plus objects added later.

    ``later`` holds objects made after the transaction (live mode: the sampler
    ``handle.sampler(...)`` returns), restored before every retry like the others.
    """

    def __init__(self, objects: StateObjects, later: dict[str, Stateful] | None = None) -> None:
        self._objects = objects
        self._later = later if later is not None else {}

    def state_dict(self) -> dict[str, Any]:
        state = self._objects.state_dicts()
        if self._later:
            return {"objects": state, "later": {k: v.state_dict() for k, v in self._later.items()}}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._later and "later" in state:
            for name, obj in self._later.items():
                obj.load_state_dict(state["later"][name])
            state = state["objects"]
        self._objects.load(state)


def check_faults(
    faults: Any, mtgs: MTGSConfig | None, *, replica: int | None = None, spare: bool = False
) -> FaultInjector | None:
    """Validate ``enable_resiliency(faults=...)`` before any collective; ``ConfigError``.

    In live mode (``replica`` given) a fault's number is a replica id: the injector must be
    built for this process's replica (``LMR_REPLICA_GROUP``). A warm spare (``spare``) has no
    replica yet: the front door renumbers its injector for the replica it takes over.
    """
    if faults is None:
        return None
    if not isinstance(faults, FaultInjector):
        raise ConfigError(
            f"faults must be a lm_resiliency.faults.FaultInjector, got {type(faults).__name__}; "
            "e.g. faults=FaultInjector('nan_grad@1:7', rank=rank)"
        )
    if mtgs is None:
        raise ConfigError(
            f"faults={faults.schedule.spec() or 'an empty schedule'!r} needs mtgs=MTGSConfig(...): "
            "the transaction tells the injector each step and attempt; without it no "
            "scheduled fault would ever fire"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    # A warm spare's faults are renumbered for the replica it takes over.
    if not spare and replica is not None and faults.rank != replica:
        raise ConfigError(
            f"faults was built for rank={faults.rank} but this process is replica {replica} "
            "(live membership numbers faults by replica group); build it with "
            "FaultInjector(schedule, rank=int(os.environ['LMR_REPLICA_GROUP']))"
        )
    if not spare and replica is None and faults.rank != rank:
        raise ConfigError(
            f"faults was built for rank={faults.rank} but this process is rank {rank}; "
            "build it with FaultInjector(schedule, rank=dist.get_rank())"
        )
    if len(faults.schedule) and not faults.armed and not faults.dry_run:
        raise ConfigError(
            f"faults={faults.schedule.spec()!r} is not armed: call injector.arm() or set "
            "LM_RESILIENCY_FAULTS=1 in the processes meant to fail (or use dry_run=True)"
        )
    return faults


def attach_faults(faults: FaultInjector, adapter: Adapter) -> bool:
    """Install the injector's hooks on the adapter's model and optimizer unless installed.

    Returns whether it installed them (the handle then removes them on close).
    """
    if faults.installed:
        return False
    (model, *_) = adapter.modules()
    faults.install(model, adapter.step_optimizers()[0])
    return True


def build_mtgs(
    adapter: Adapter,
    objects: StateObjects,
    config: MTGSConfig,
    *,
    committed_steps: int,
    faults: FaultInjector | None = None,
    reducer: Reducer | None = None,
    max_membership_changes: int | None = None,
    later: dict[str, Stateful] | None = None,
) -> MTGS:
    """The step transaction for a DDP adapter; raises ``ConfigError`` for ambiguous state.

    ``reducer``/``max_membership_changes``: live mode's reducer and budget (``MTGS``'s);
    ``later``: data state objects that appear after the transaction (the live sampler).
    """
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
        data_state=_DataState(data, later) if len(data) or later is not None else None,
        faults=faults,
        committed_steps=committed_steps,
        reducer=reducer,
        max_membership_changes=max_membership_changes,
    )

"""The Megatron Core adapter: ``enable_resiliency(model_chunks, optimizer, scheduler=...)``.

What one rank captures (never gathered):

* per distributed optimizer: the main-param shards and their optimizer state
  (see :mod:`.optimizer`), and the param-group hyperparameters (the ``lr`` and
  ``weight_decay`` the scheduler wrote; construction-time objects in a group
  are not state and are left out);
* the ``OptimizerParamScheduler`` when given;
* the CUDA RNG tracker's named states (``get_cuda_rng_tracker().get_states()``:
  the model- and expert-parallel streams dropout and initialization fork to).

Re-derived on restore: the model params from the shards, and the full params
on every rank (param all-gather, collective over the data-parallel group).
The handle captures torch's default RNGs and the step count itself.

Step boundary: the inner torch optimizers' public step hooks, completed at the
next forward of a model chunk (the user's ``scheduler.step()`` runs after
``optimizer.step()``), see :mod:`lm_resiliency.integrations._inner_hooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.capture.buffers import (
    BoundaryBuffers,
    match_persistent_buffers,
    write_buffers,
)
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._inner_hooks import bind_deferred_steps
from lm_resiliency.integrations._optim_state import (
    capture_hparams,
    capture_state,
    check_layout,
    restore_hparams,
    restore_state,
)
from lm_resiliency.integrations.base import AdapterBase, ParallelLayout, StepBoundary, Unbind
from lm_resiliency.integrations.megatron.optimizer import (
    ShardedOptimizer,
    model_chunks,
    sharded_optimizers,
)
from lm_resiliency.state import Deferred

__all__ = ["MegatronAdapter"]


class MegatronAdapter(AdapterBase):
    """One rank's view of Megatron Core model chunks and their distributed optimizer.

    Construction is local. ``load_state_dict`` is collective over the
    data-parallel group (the param all-gather).
    """

    framework = "megatron"
    capture_before_scheduler_step = False  # its step ends after the scheduler step

    def __init__(self, model: Any, optimizer: Any, *, scheduler: Any = None) -> None:
        self.chunks = model_chunks(model)
        self.optimizer = optimizer
        self.parts: list[ShardedOptimizer] = sharded_optimizers(optimizer)
        self.scheduler = scheduler
        self._buffers = [BoundaryBuffers(chunk) for chunk in self.chunks]
        super().__init__([p.inner for p in self.parts])

    def bind(self, boundary: StepBoundary) -> Unbind:
        inners = [p.inner for p in self.parts]
        return bind_deferred_steps(inners, len(inners), self.chunks, boundary)

    def _identity(self) -> dict[str, Any]:
        from megatron.core import parallel_state as ps

        return {
            "dp_world_size": ps.get_data_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(),
            "tp_world_size": ps.get_tensor_model_parallel_world_size(),
            "pp_world_size": ps.get_pipeline_model_parallel_world_size(),
            "master_numels": [[int(m.numel()) for m in p.masters] for p in self.parts],
        }

    def state_dict(self) -> dict[str, Any]:
        state = self.capture_state()
        state["identity"] = state["identity"].resolve()
        state["optimizers"] = [dict(part.resolve()) for part in state["optimizers"]]
        return state

    def capture_state(self) -> dict[str, Any]:
        """The capture tree; what is per master tensor is built by the capture worker.

        The masters and their optimizer state change only in the step, whose hook
        waits for the capture; the group hyperparameters (the scheduler writes them),
        the scheduler, the RNG tracker and the buffers (the next forward changes
        them) are taken now.
        """
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {
            "identity": Deferred(self._identity),
            "optimizers": [
                Deferred(partial(_part_state, p, capture_hparams(p.inner))) for p in self.parts
            ],
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng_tracker": dict(get_cuda_rng_tracker().get_states()),
            # Copied now: buffers change inside the next forward (BatchNorm statistics).
            "buffers": [b.copies() for b in self._buffers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self._check_identity(state["identity"])
        saved_buffers = state.get("buffers") or [None] * len(self.chunks)
        if len(saved_buffers) != len(self.chunks):
            raise ConfigError(
                f"Megatron: the checkpoint holds buffers of {len(saved_buffers)} model chunks but "
                f"the model has {len(self.chunks)}; restore into the same model"
            )
        # Every chunk's buffers are checked before any is written (then written first).
        pairs = [
            pair
            for chunk, buffers in zip(self.chunks, saved_buffers, strict=True)
            for pair in match_persistent_buffers(chunk, buffers, what="Megatron")
        ]
        write_buffers(pairs)
        saved_sched = state["scheduler"]
        if (self.scheduler is None) != (saved_sched is None):
            raise ConfigError(
                "Megatron: the checkpoint was captured "
                f"{'without' if saved_sched is None else 'with'} a scheduler but "
                f"{'one' if self.scheduler is not None else 'none'} was given now; pass the "
                "same scheduler= to enable_resiliency"
            )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved_sched)  # sets lr/wd of the groups too
        for part, saved in zip(self.parts, state["optimizers"], strict=True):
            with torch.no_grad():
                for master, value in zip(part.masters, saved["masters"], strict=True):
                    master.copy_(value)
            restore_state(part.inner, part.masters, saved["state"], what="Megatron")
            restore_hparams(part.inner, saved["param_groups"], what="Megatron")
            part.copy_masters_to_model()
        for chunk in self.chunks:
            sync: Any = chunk.start_param_sync  # Megatron's DDP wrapper, not a plain Module
            sync(force_sync=True)
        tracker = get_cuda_rng_tracker()
        live = sorted(tracker.get_states())
        if sorted(state["rng_tracker"]) != live:
            raise ConfigError(
                f"Megatron: the checkpoint's RNG tracker has states {sorted(state['rng_tracker'])} "
                f"but this process has {live}; seed with the same model_parallel_cuda_manual_seed"
            )
        tracker.set_states({k: v.clone() for k, v in state["rng_tracker"].items()})

    def _check_identity(self, saved: dict[str, Any]) -> None:
        check_layout(
            saved,
            self._identity(),
            what="Megatron",
            advice="restore with the same tensor/pipeline/data-parallel sizes and model, or "
            "resume from a dist_checkpointing checkpoint (it re-shards)",
        )

    def parallel_layout(self) -> ParallelLayout:
        from megatron.core import parallel_state as ps

        # Distributed-optimizer shards differ on every data-parallel rank: no natural
        # replicas; the manager pairs ranks one node apart.
        own = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group()))
        return ParallelLayout(comparison_groups=(own,) if len(own) == dist.get_world_size() else ())

    def modules(self) -> Sequence[torch.nn.Module]:
        return list(self.chunks)


def _part_state(part: ShardedOptimizer, hparams: list[dict[str, Any]]) -> dict[str, Any]:
    """One distributed optimizer's masters and their state (by reference), its hyperparameters."""
    return {
        "masters": list(part.masters),
        "state": capture_state(part.inner, part.masters),
        "param_groups": hparams,
    }


def make_adapter(
    model: Any,
    optimizers: Sequence[Any],
    *,
    optimizer: Any = None,
    scheduler: Any = None,
) -> MegatronAdapter:
    """Registry entry: model chunk(s) and the Megatron optimizer (positional or ``optimizer=``)."""
    given = [o for o in (*optimizers, optimizer) if o is not None]
    if len(given) != 1:
        raise ConfigError(
            f"Megatron needs exactly one optimizer (got {len(given)}): "
            "enable_resiliency(model_chunks, optimizer, scheduler=scheduler) with the "
            "optimizer get_megatron_optimizer returned"
        )
    return MegatronAdapter(model, given[0], scheduler=scheduler)

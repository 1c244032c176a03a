"""The DeepSpeed adapter: ``enable_resiliency(engine)`` for ZeRO stages 1, 2 and 3.

What one rank captures (never gathered; every tensor is this rank's alone):

* its fp32 master partitions and their optimizer state (``exp_avg``,
  ``exp_avg_sq``, ``step`` for Adam), see :mod:`.zero` for where each stage
  keeps them. ZeRO-1/2 partitions are as rank-unique as ZeRO-3's: they are
  replicated to the peer like any other state;
* the optimizer's param-group hyperparameters (the ``lr`` a scheduler set),
  the engine's LR scheduler, and the engine's counters (``global_steps``,
  ``global_samples``, ``micro_steps``, ``skipped_steps``).

Re-derived on restore, not captured: the low-precision parameters (bf16, or
the fp32 model copy) and ZeRO-3's gathered parameters, rebuilt from the
masters by DeepSpeed's own routines (a collective over the data-parallel
group). The handle captures the RNGs and the step count itself.

The step boundary comes from public torch hooks on the wrapped torch optimizer
(one engine step calls it once per param group, ZeRO-3: per sub-group) and on
the engine's module: the engine advances its scheduler and counters after the
optimizer, so the step counts as done at the next forward
(:mod:`lm_resiliency.integrations._inner_hooks`).

Durable fallback: with ``checkpoint_dir``, ``engine.load_checkpoint(checkpoint_dir,
tag=checkpoint_tag)`` (the ``latest`` tag when None) is the loader used when no
GEMINI step is available on every rank. SCOUT's durable candidates go to the same
folder, under tags ``latest`` names only once they are verified (:mod:`.candidates`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.capture.buffers import load_persistent_buffers, persistent_buffers
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._inner_hooks import bind_deferred_steps
from lm_resiliency.integrations._optim_state import (
    capture_hparams,
    capture_state,
    check_layout,
    restore_hparams,
    restore_state,
)
from lm_resiliency.integrations.base import (
    AdapterBase,
    DurableCandidate,
    DurableFallback,
    ParallelLayout,
    StepBoundary,
    Unbind,
)
from lm_resiliency.integrations.deepspeed.candidates import CapturedBuffers, durable_candidates
from lm_resiliency.integrations.deepspeed.zero import ZeroView, zero_view

__all__ = ["DeepSpeedAdapter"]

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class DeepSpeedAdapter(AdapterBase):
    """One rank's view of a ``deepspeed.DeepSpeedEngine`` (see the module doc).

    Construction is local. ``load_state_dict`` is collective over the engine's
    data-parallel group (it re-gathers the low-precision parameters).
    """

    framework = "deepspeed"
    capture_before_scheduler_step = False  # its step ends after the scheduler step

    def __init__(
        self,
        engine: Any,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_tag: str | None = None,
    ) -> None:
        self.engine = engine
        stage = int(engine.zero_optimization_stage())
        self.view: ZeroView = zero_view(engine.optimizer, stage)
        super().__init__([self.view.inner])
        self._dp_group = self.view.zero.dp_process_group
        self._checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self._checkpoint_tag = checkpoint_tag
        self._buffers: CapturedBuffers | None = None  # the newest capture's, for candidates

    # ------------------------------------------------------------------ seam
    def bind(self, boundary: StepBoundary) -> Unbind:
        view = self.view
        steps = view.inner_steps_per_step
        return bind_deferred_steps([view.inner], steps, self.modules(), boundary)

    def _identity(self) -> dict[str, Any]:
        return {
            "stage": self.view.stage,
            "optimizer": self.view.kind,
            "dp_world_size": dist.get_world_size(self._dp_group),
            "dp_rank": dist.get_rank(self._dp_group),
            "master_numels": [int(m.numel()) for m in self.view.masters],
            "master_dtypes": [str(m.dtype).removeprefix("torch.") for m in self.view.masters],
        }

    def state_dict(self) -> dict[str, Any]:
        view = self.view
        sched = self.engine.lr_scheduler
        # Copied now: buffers change inside the next forward (BatchNorm statistics).
        buffers = persistent_buffers(self.engine.module)
        self._buffers = (int(self.engine.global_steps), buffers)
        return {
            "identity": self._identity(),
            "masters": list(view.masters),
            "optimizer_state": capture_state(view.inner, view.masters),
            "param_groups": capture_hparams(view.inner),
            "engine": {name: int(getattr(self.engine, name)) for name in _COUNTERS},
            "lr_scheduler": None if sched is None else sched.state_dict(),
            "buffers": buffers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_identity(state["identity"])
        # Checked in full before anything is written (then the buffers are written first).
        load_persistent_buffers(self.engine.module, state.get("buffers"), what="DeepSpeed")
        view = self.view
        view.before_restore()
        with torch.no_grad():
            for master, saved in zip(view.masters, state["masters"], strict=True):
                master.copy_(saved)
        restore_state(view.inner, view.masters, state["optimizer_state"], what="DeepSpeed")
        restore_hparams(view.inner, state["param_groups"], what="DeepSpeed")
        for name in _COUNTERS:
            setattr(self.engine, name, int(state["engine"][name]))
        sched, saved_sched = self.engine.lr_scheduler, state["lr_scheduler"]
        if (sched is None) != (saved_sched is None):
            raise ConfigError(
                "DeepSpeed: the checkpoint was captured "
                f"{'without' if saved_sched is None else 'with'} an LR scheduler but the "
                f"engine has {'one' if sched is not None else 'none'}; configure the same scheduler"
            )
        if sched is not None:
            sched.load_state_dict(saved_sched)
        view.rederive()

    def _check_identity(self, saved: dict[str, Any]) -> None:
        check_layout(
            saved,
            self._identity(),
            what="DeepSpeed",
            advice="restore with the same ZeRO stage, data-parallel world size and model, or "
            "resume from DeepSpeed's own checkpoint (universal checkpoints re-partition)",
        )

    def parallel_layout(self) -> ParallelLayout:
        # Every data-parallel rank owns a different partition: no natural replicas; the
        # manager pairs ranks by replication_jump (default: one node apart).
        return ParallelLayout(comparison_groups=_dp_groups(self.engine, self._dp_group))

    def durable_fallback(self) -> DurableFallback | None:
        if self._checkpoint_dir is None:
            return None
        return durable_loader(self.engine, self._checkpoint_dir, tag=self._checkpoint_tag)

    def durable_candidate(self) -> DurableCandidate | None:
        """With ``checkpoint_dir``: SCOUT's candidates saved there, named by ``latest`` only
        once verified (:mod:`.candidates`); ``None`` without it."""
        if self._checkpoint_dir is None:
            return None
        return durable_candidates(self.engine, self._checkpoint_dir, lambda: self._buffers)

    def modules(self) -> Sequence[torch.nn.Module]:
        return [self.engine.module]


def durable_loader(
    engine: Any, checkpoint_dir: str | os.PathLike[str], *, tag: str | None = None
) -> DurableFallback:
    """DeepSpeed's own checkpoint as the fallback: ``enable_resiliency(engine, load_fallback=...)``.

    The returned callable runs on every rank when no GEMINI step is available
    on all of them: ``engine.load_checkpoint(checkpoint_dir, tag=tag)`` (the
    ``latest`` tag when None; model, ZeRO partitions, optimizer and scheduler)
    and returns the engine's ``global_steps``, or ``None`` when nothing was
    saved there yet (a fresh start). Collective like ``load_checkpoint``.
    """
    load_dir = os.fspath(checkpoint_dir)

    def load() -> int | None:
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            return None  # nothing saved yet: DeepSpeed would only warn
        path, _ = engine.load_checkpoint(load_dir, tag=tag)
        return None if path is None else int(engine.global_steps)

    return load


def _dp_groups(engine: Any, dp_group: Any) -> tuple[tuple[int, ...], ...]:
    """Data-parallel groups in world ranks, when known without a collective."""
    world = dist.get_world_size()
    own = tuple(dist.get_process_group_ranks(dp_group))
    if len(own) == world:
        return (own,)
    grid = getattr(engine, "grid", None)  # pipeline engines know every group
    groups = getattr(grid, "dp_groups", None)
    if groups:
        return tuple(tuple(int(r) for r in g) for g in groups)
    return ()


def make_adapter(
    engine: Any, optimizers: Sequence[torch.optim.Optimizer], **options: Any
) -> DeepSpeedAdapter:
    """Registry entry: ``enable_resiliency(engine)``; the engine owns its optimizer."""
    if optimizers:
        raise ConfigError(
            "a DeepSpeed engine owns its optimizer: call enable_resiliency(engine) without "
            "an optimizer"
        )
    return DeepSpeedAdapter(engine, **options)

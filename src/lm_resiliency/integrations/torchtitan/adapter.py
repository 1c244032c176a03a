"""The TorchTitan adapter: ``enable_resiliency(trainer)`` for a ``torchtitan.trainer.Trainer``.

::

    trainer = config.build()                     # TorchTitan builds model, optimizers, data
    handle = enable_resiliency(trainer, interval=10)   # recovers: GEMINI, else DCP
    trainer.train()                              # TorchTitan's own loop, unchanged
    handle.close()

What one rank captures (never gathered):

* the FSDP2 model part and its optimizers: the local shard of every parameter
  and optimizer-state entry, the param-group hyperparameters, the shard
  layout (:class:`~lm_resiliency.integrations.fsdp.FSDPAdapter`'s path, over
  the torch optimizers inside TorchTitan's ``OptimizersContainer``);
* the LR schedulers' ``last_epoch`` (all of TorchTitan's ``LRSchedulersContainer``
  state: its ``LambdaLR`` schedules are functions of it);
* the train state ``step`` (shared) and ``ntokens_seen`` (per rank);
* the data position: the plain-valued ``StatefulDataLoader`` state under
  TorchTitan's ``ParallelAwareDataloader`` (whose own ``state_dict()`` pickles
  it; restored bytes are never unpickled here), per rank.

The step boundary is the ``OptimizersContainer``'s public step hooks (it is a
``torch.optim.Optimizer``): the pre-hook waits for the capture in flight, the
post-hook captures. At the post-hook of step N the update is done, the data
loader and ``ntokens_seen`` are past step N's batches (``train_step`` fetches
them all before its forward) and ``trainer.step`` is N; only
``lr_schedulers.step()``, the next line of ``train_step``, has not run yet.
So the schedulers are captured as they will be after it (``last_epoch + 1``)
and the restore replays that one call (``load_state_dict(last_epoch - 1)``,
then ``lr_schedulers.step()``, which also writes the LR into the param
groups exactly as in the uninterrupted run). The pre-hook of the next step
checks that the schedulers did advance by exactly one and raises
``ConfigError`` otherwise (a loop that steps them differently).

Recovery and ``train()``'s own checkpoint load: see :mod:`.resume`. The
durable fallback is TorchTitan's checkpointer (``checkpointer.load``); SCOUT's
durable candidates are DCP checkpoints beside TorchTitan's own that its load
finds only once they are verified (:mod:`.candidates`).

Supported (``ConfigError`` otherwise): one model part (no pipeline
parallelism), FSDP2 or HSDP data parallelism without tensor/context/expert
parallelism, a ``StatefulDataLoader`` with ``num_workers=0``,
``checkpoint.load_step=-1``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import (
    AdapterBase,
    DurableCandidate,
    DurableFallback,
    ParallelLayout,
    StepBoundary,
    Unbind,
)
from lm_resiliency.integrations.fsdp import FSDPAdapter
from lm_resiliency.integrations.torchtitan.candidates import CapturedPosition, dcp_candidates
from lm_resiliency.integrations.torchtitan.resume import SkipFirstLoad, load_durable

__all__ = ["TorchTitanAdapter", "make_adapter"]


class TorchTitanAdapter(AdapterBase):
    """One rank's view of a built TorchTitan ``Trainer`` (see the module doc).

    Construct on every rank after ``config.build()`` and before ``train()``.
    Local; ``load_state_dict`` is local too (in-place copies).
    """

    framework = "torchtitan"

    def __init__(self, trainer: Any) -> None:
        check_supported(trainer)
        self.trainer = trainer
        self.container = trainer.optimizers
        super().__init__([self.container])
        self.fsdp = FSDPAdapter(trainer.model_parts[0], list(self.container))
        self.schedulers = trainer.lr_schedulers
        self.dataloader = trainer.dataloader
        self._skip = SkipFirstLoad(trainer.checkpointer)
        self._epoch_after: int | None = None
        self._position: CapturedPosition | None = None  # the newest capture's (candidates)

    # -- the boundary --------------------------------------------------------------

    def bind(self, boundary: StepBoundary) -> Unbind:
        """The container's step hooks; also skips ``train()``'s first checkpoint load."""
        self._skip.hold()

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._skip.restore()
            self._check_schedulers_stepped()
            boundary.before_step()

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._epoch_after = self._epoch() + 1
            boundary.after_step()

        handles = [
            self.container.register_step_pre_hook(pre),
            self.container.register_step_post_hook(post),
        ]

        def unbind() -> None:
            for h in handles:
                h.remove()
            handles.clear()
            self._skip.restore()

        return unbind

    def _epoch(self) -> int:
        return int(self.schedulers.state_dict()["last_epoch"])

    def _check_schedulers_stepped(self) -> None:
        expected, self._epoch_after = self._epoch_after, None
        if expected is not None and self._epoch() != expected:
            raise ConfigError(
                f"TorchTitan's LR schedulers are at last_epoch={self._epoch()} at the start of "
                f"this optimizer step, expected {expected}: the adapter captures at the "
                "optimizer step and relies on train_step calling lr_schedulers.step() exactly "
                "once right after it; a loop that steps them otherwise is not supported"
            )

    # -- capture -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self._state(self.fsdp.state_dict())

    def capture_state(self) -> dict[str, Any]:
        # The FSDP2 part's per-parameter work runs on the capture worker (FSDPAdapter).
        return self._state(self.fsdp.capture_state())

    def _state(self, fsdp: dict[str, Any]) -> dict[str, Any]:
        return {
            "fsdp": fsdp,
            "lr_schedulers": {"last_epoch": self._captured_epoch()},
            "train_state": {"step": int(self.trainer.step)},
        }

    def _captured_epoch(self) -> int:
        return self._epoch_after if self._epoch_after is not None else self._epoch()

    def rank_state_dict(self) -> dict[str, Any]:
        # A deep copy: the dataset's state holds its live token buffers, which the
        # next fetch extends in place.
        data = copy.deepcopy(StatefulDataLoader.state_dict(self.dataloader))
        ntokens = int(self.trainer.ntokens_seen)
        # Kept for a durable candidate of this step, written up to a step later.
        self._position = CapturedPosition(
            int(self.trainer.step), self._captured_epoch(), ntokens, data
        )
        return {
            "fsdp": self.fsdp.rank_state_dict(),
            "dataloader": data,
            "data_parallel": self._data_parallel(),
            "ntokens_seen": ntokens,
        }

    def _data_parallel(self) -> list[int]:
        return [int(self.dataloader.dp_rank), int(self.dataloader.dp_world_size)]

    # -- restore -------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fsdp.load_state_dict(state["fsdp"])
        epoch = int(state["lr_schedulers"]["last_epoch"])
        self.schedulers.load_state_dict({"last_epoch": epoch - 1})
        with warnings.catch_warnings():
            # torch warns when a scheduler steps before its optimizer in this process;
            # this is the replay of the call that followed the captured optimizer step.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.schedulers.step()
        self.trainer.step = int(state["train_state"]["step"])

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        saved = [int(x) for x in state["data_parallel"]]
        if saved != self._data_parallel():
            raise ConfigError(
                f"the data position was captured by data-parallel rank {saved[0]} of {saved[1]} "
                f"but this rank is {self._data_parallel()[0]} of {self._data_parallel()[1]}; "
                "GEMINI restores onto the same data-parallel layout (TorchTitan's data loader "
                "does not reshard)"
            )
        self.fsdp.load_rank_state_dict(state["fsdp"])
        StatefulDataLoader.load_state_dict(self.dataloader, state["dataloader"])
        # Create the restored iterator now: creating it draws a base seed from torch's
        # default generator, which the handle restores after this call. train()'s
        # iter(dataloader) then takes this iterator (torchdata hands out the one a
        # state_dict() created) instead of drawing again.
        StatefulDataLoader.state_dict(self.dataloader)
        self.trainer.ntokens_seen = int(state["ntokens_seen"])

    # -- the rest of the seam ------------------------------------------------------

    def parallel_layout(self) -> ParallelLayout:
        return self.fsdp.parallel_layout()

    def durable_fallback(self) -> DurableFallback | None:
        trainer = self.trainer
        return lambda: load_durable(trainer)

    def durable_candidate(self) -> DurableCandidate | None:
        """SCOUT's candidates as DCP checkpoints TorchTitan's load ignores until verified.

        ``None`` when TorchTitan's checkpointing is off (see :mod:`.candidates`).
        """
        return dcp_candidates(self.trainer, lambda: self._position)

    def modules(self) -> Sequence[torch.nn.Module]:
        return [self.trainer.model_parts[0]]

    def close(self) -> None:
        self._skip.restore()


def check_supported(trainer: Any) -> None:
    """Raise ``ConfigError`` for a Trainer configuration the adapter does not handle."""
    dims = trainer.parallel_dims
    parts = trainer.model_parts
    if dims.pp_enabled or len(parts) != 1:
        raise ConfigError(
            f"TorchTitan with pipeline parallelism ({len(parts)} model parts, pp={dims.pp}) is "
            "not supported by enable_resiliency; set parallelism.pipeline_parallel_degree=1"
        )
    others = {"tp": dims.tp, "cp": dims.cp, "ep": dims.ep}
    used = {k: v for k, v in others.items() if v > 1}
    if used:
        raise ConfigError(
            f"TorchTitan with {used} is not supported by enable_resiliency (tested: FSDP2 "
            "data_parallel_shard_degree and HSDP data_parallel_replicate_degree only); set the "
            "tensor/context/expert parallel degrees to 1"
        )
    if not dims.fsdp_enabled:
        raise ConfigError(
            f"TorchTitan without FSDP2 sharding (world_size={dims.world_size}, "
            f"dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard}) is not supported by "
            "enable_resiliency: the adapter captures FSDP2 DTensor shards; use "
            "data_parallel_shard_degree > 1 (FSDP2, or HSDP with data_parallel_replicate_degree)"
        )
    loader = trainer.dataloader
    if not isinstance(loader, StatefulDataLoader):
        raise ConfigError(
            f"the Trainer's data loader is a {type(loader).__name__}, not a torchdata "
            "StatefulDataLoader: enable_resiliency cannot capture its position as plain values"
        )
    if not (hasattr(loader, "dp_rank") and hasattr(loader, "dp_world_size")):
        raise ConfigError(
            f"the Trainer's data loader ({type(loader).__name__}) has no dp_rank/dp_world_size; "
            "enable_resiliency needs TorchTitan's ParallelAwareDataloader (or a subclass), "
            "whose position is per data-parallel rank"
        )
    if int(getattr(loader, "num_workers", 0)) != 0:
        raise ConfigError(
            f"dataloader.num_workers={loader.num_workers} is not supported by "
            "enable_resiliency (tested with 0: the position is read from the main process)"
        )
    load_step = int(trainer.config.checkpoint.load_step)
    if load_step != -1:
        raise ConfigError(
            f"checkpoint.load_step={load_step} asks TorchTitan to resume from that DCP step, "
            "but enable_resiliency resumes from the newest GEMINI step first; leave "
            "checkpoint.load_step at -1, or resume that step without enable_resiliency"
        )


def make_adapter(trainer: Any, optimizers: Sequence[Any], **options: Any) -> TorchTitanAdapter:
    """Registry entry: ``enable_resiliency(trainer)``; the Trainer owns its optimizers."""
    if optimizers:
        raise ConfigError(
            "a TorchTitan Trainer owns its optimizers; call enable_resiliency(trainer) "
            "without an optimizer"
        )
    if options:
        raise ConfigError(f"the TorchTitan adapter takes no options, got {sorted(options)}")
    return TorchTitanAdapter(trainer)

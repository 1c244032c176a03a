"""Hugging Face ``transformers.Trainer``: the adapter behind ``ResiliencyCallback``.

:class:`HFAdapter` is what one rank captures of a Trainer (model, optimizer,
scheduler, the Trainer's state and running counters, the data position, DDP's
bucket order) and how it is put back; the callback that builds it at train
begin and drives it is the Trainer's front door,
:class:`lm_resiliency.hf.ResiliencyCallback` (where it hangs and its
limits are documented there). ``enable_resiliency(trainer)`` is refused with
the pointer to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.capture.buffers import snapshot_buffers
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._ddp_buckets import (
    ReadyOrder,
    check_replayable,
    needs_replay,
    reducer_params,
    replay_ready_order,
)
from lm_resiliency.integrations.base import AdapterBase, StepBoundary, Unbind

__all__ = ["HFAdapter", "dataloader_length", "make_adapter"]

_TRAINER_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen")
# The Trainer's own running counters (transformers 5): the loss summed since the last
# log (a tensor, added to in place), the logged sum, the step last logged, and this
# rank's FLOs not yet added to ``state.total_flos`` (that happens at a log or a save).
_RUNNING_FIELDS = ("_total_loss_scalar", "_globalstep_last_logged", "current_flos")


class HFAdapter(AdapterBase):
    """The Trainer's model, optimizer, scheduler, state and data position (built at train begin)."""

    framework = "hf"
    capture_before_scheduler_step = False  # its step ends after the scheduler step

    def __init__(
        self,
        *,
        trainer: Any = None,
        model: torch.nn.Module,
        wrapped: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trainer_state: Any,
        dataloader: Any,
        accumulation: int,
    ) -> None:
        super().__init__([optimizer])
        self.trainer = trainer
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.trainer_state = trainer_state
        self.dataloader = dataloader
        self.accumulation = accumulation
        self.boundary: StepBoundary | None = None
        self.skipped_batches = 0
        self.ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        self._recorder: ReadyOrder | None = None
        self._order: list[int] = []
        if self.ddp is not None:
            check_replayable(self.ddp)
            if needs_replay(self.ddp):
                self._recorder = ReadyOrder(reducer_params(self.ddp))

    def bind(self, boundary: StepBoundary) -> Unbind:
        """The callback drives the boundary (no optimizer hooks: the Trainer owns the loop)."""
        self.boundary = boundary

        def unbind() -> None:
            self.boundary = None

        return unbind

    def state_dict(self) -> dict[str, Any]:
        if self._recorder is not None and self._recorder.order is not None:
            self._order = list(self._recorder.order)
        model = self.model.state_dict()
        snapshot_buffers(self.model, model)  # the forward that follows changes them in place
        return {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "trainer": {k: getattr(self.trainer_state, k) for k in _TRAINER_FIELDS},
            "running": self._running(),
            "ddp": {"ready_order": list(self._order)},
        }

    def _running(self) -> dict[str, Any]:
        """The Trainer's running loss and FLO counters (those it has; see ``_RUNNING_FIELDS``)."""
        out: dict[str, Any] = {}
        if self.trainer is None:
            return out
        for key in _RUNNING_FIELDS:
            if hasattr(self.trainer, key):
                out[key] = getattr(self.trainer, key)
        loss = getattr(self.trainer, "_tr_loss", None)
        if isinstance(loss, torch.Tensor):
            out["_tr_loss"] = loss.detach().clone()  # added to in place by the next step
        return out

    def _load_running(self, saved: dict[str, Any]) -> None:
        if self.trainer is None:
            return
        for key, value in saved.items():
            if key == "_tr_loss":
                live = getattr(self.trainer, "_tr_loss", None)
                if isinstance(live, torch.Tensor):
                    with torch.no_grad():
                        live.copy_(value)
            elif hasattr(self.trainer, key):
                setattr(self.trainer, key, value)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for key in _TRAINER_FIELDS:
            setattr(self.trainer_state, key, state["trainer"][key])
        self._load_running(state.get("running", {}))
        order = list(state["ddp"]["ready_order"])
        if self.ddp is not None and order:
            replay_ready_order(self.ddp, order)
            self._order = order
        self.skip_to(int(state["trainer"]["global_step"]))

    def skip_to(self, global_step: int) -> None:
        """Make the Trainer's data loader start after the batches of ``global_step`` steps."""
        batches = global_step * self.accumulation
        per_epoch = dataloader_length(self.dataloader)
        if per_epoch is not None and batches >= per_epoch:
            raise ConfigError(
                f"recovered step {global_step} lies past the first pass over the data loader "
                f"({per_epoch} batches, {self.accumulation} per step): a callback cannot make "
                "the Trainer skip whole epochs; keep each train() call within one pass "
                "(e.g. max_steps) or resume from a durable checkpoint with resume_from_checkpoint"
            )
        if not hasattr(self.dataloader, "skip_batches"):
            raise ConfigError(
                f"the Trainer's data loader ({type(self.dataloader).__name__}) cannot skip "
                "batches; ResiliencyCallback needs accelerate's prepared data loader"
            )
        self.dataloader.skip_batches = batches
        self.skipped_batches = batches

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()

    def modules(self) -> Sequence[torch.nn.Module]:
        return [self.model]


def dataloader_length(dataloader: Any) -> int | None:
    """Batches per epoch of ``dataloader`` (``None`` for an iterable dataset)."""
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset
        return None


def make_adapter(obj: Any, optimizers: Sequence[torch.optim.Optimizer], **options: Any) -> Any:
    """``enable_resiliency(trainer)`` is not the Trainer integration: say what is."""
    raise ConfigError(
        "a transformers.Trainer creates its optimizer inside train(); add the callback instead: "
        "trainer.add_callback(lm_resiliency.hf.ResiliencyCallback(trainer, "
        "interval=10))"
    )

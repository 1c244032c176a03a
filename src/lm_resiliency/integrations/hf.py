"""Hugging Face ``transformers.Trainer``: a ``TrainerCallback`` that gives the Trainer every tier.

::

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    trainer.add_callback(ResiliencyCallback(trainer, interval=10))
    trainer.train()                      # no resume_from_checkpoint: recovery is automatic

Where it hangs (callback events, all ranks, same order):

* ``on_train_begin``: the optimizer, scheduler and the prepared (DDP) model
  exist; GEMINI recovers (collective) the model, optimizer, LR scheduler,
  the Trainer's state (global step, epoch, FLOs, tokens seen), its running
  loss and FLO counters (so ``train_loss`` and ``total_flos`` cover every step,
  as in an uninterrupted run) and the data position: the Trainer's data
  loader skips the batches the recovered steps consumed (accelerate's
  ``skip_batches``), as the Trainer's own resume does. A DDP model gets the
  bucket layout of the uninterrupted run (see
  :mod:`lm_resiliency.integrations.ddp`). When ``train(resume_from_checkpoint=...)``
  already restored a Trainer checkpoint (``state.global_step > 0`` at train
  begin) that resume wins: no GEMINI step is recovered over it, and the
  captures continue from its step.
* ``on_step_begin`` of step N+1 is the capture point of step N: the update,
  the scheduler step and ``zero_grad`` are done, the next batch is fetched,
  the forward has not run. The generators are captured here, so the dropout
  of step N+1 draws what it drew in the uninterrupted run, and restored here
  after a recovery (after the Trainer created its data iterator).
* ``on_pre_optimizer_step``: waits for the capture in flight.
* ``on_train_end``: closes the handle (collective).

Limits (checked at train begin, before any step, ``ConfigError``): every
capture must lie in the first pass over the data loader of this ``train()``
call (the Trainer restarts its epoch loop at 0 and only its own
``resume_from_checkpoint`` can skip whole epochs), so a ``max_steps`` whose
last capture lies past it is refused at once; a ``gradient_accumulation_steps``
that does not divide the batches per epoch is rejected for the same reason
(the Trainer's last partial accumulation is keyed on its epoch-local batch
index). After a recovery the callback sets ``state.epoch`` at each step end to
the uninterrupted run's value (the Trainer counts the skipped batches out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from lm_resiliency.capture.buffers import snapshot_buffers
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._ddp_buckets import (
    ReadyOrder,
    check_replayable,
    needs_replay,
    reducer_params,
    replay_ready_order,
)
from lm_resiliency.integrations.base import AdapterBase, StepBoundary, Unbind
from lm_resiliency.resiliency.rng import restore_rng

__all__ = ["HFAdapter", "ResiliencyCallback", "make_adapter"]

_TRAINER_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen")
# The Trainer's own running counters (transformers 5): the loss summed since the last
# log (a tensor, added to in place), the logged sum, the step last logged, and this
# rank's FLOs not yet added to ``state.total_flos`` (that happens at a log or a save).
_RUNNING_FIELDS = ("_total_loss_scalar", "_globalstep_last_logged", "current_flos")


class HFAdapter(AdapterBase):
    """The Trainer's model, optimizer, scheduler, state and data position (built at train begin)."""

    framework = "hf"

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
        per_epoch = _length(self.dataloader)
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


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset
        return None


class ResiliencyCallback(TrainerCallback):  # type: ignore[misc]
    """GEMINI for a ``transformers.Trainer``; see the module doc for where it hangs.

    ``trainer``: the Trainer this callback is added to (its prepared model is
    where DDP's bucket layout lives). ``interval``, ``load_fallback``,
    ``state`` (extra objects with ``state_dict()``/``load_state_dict()``) and
    ``config`` mean what they mean for :func:`~lm_resiliency.enable_resiliency`.
    ``handle`` is the :class:`~lm_resiliency.ResiliencyHandle` once training began.
    """

    def __init__(
        self,
        trainer: Any,
        *,
        interval: int = 10,
        load_fallback: Callable[[], int | None] | None = None,
        state: Mapping[str, Any] | None = None,
        config: InMemoryCkptConfig | None = None,
    ) -> None:
        from lm_resiliency.resiliency.validate import gemini_config

        self.trainer = trainer
        self.config = gemini_config(config, interval)
        self.load_fallback = load_fallback
        self.state = dict(state or {})
        self.handle: Any = None
        self.last_start_step: int | None = None
        """The step the latest ``train()`` began after (0: fresh)."""
        self.last_recovery: Any = None
        """The latest ``train()``'s :class:`~lm_resiliency.resiliency.recover.RecoveryInfo`."""
        self._adapter: HFAdapter | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._stepped = False
        self._per_epoch: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from lm_resiliency.resiliency.enable import enable_adapter

        optimizer = kwargs["optimizer"]
        torch_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        dataloader = kwargs.get("train_dataloader")
        per_epoch = _length(dataloader)
        accumulation = int(args.gradient_accumulation_steps)
        if per_epoch is not None and per_epoch % accumulation:
            raise ConfigError(
                f"gradient_accumulation_steps={accumulation} does not divide the {per_epoch} "
                "batches per epoch; ResiliencyCallback needs whole accumulation groups per epoch"
            )
        # train(resume_from_checkpoint=...) restored the Trainer's own checkpoint: it wins.
        resumed = int(state.global_step) if int(state.global_step) > 0 else None
        if resumed is None:
            self._check_first_pass(int(state.max_steps), accumulation, per_epoch)
        self._per_epoch = per_epoch
        self._adapter = HFAdapter(
            trainer=self.trainer,
            model=kwargs["model"],
            wrapped=getattr(self.trainer, "model_wrapped", None),
            optimizer=torch_opt,
            scheduler=kwargs.get("lr_scheduler"),
            trainer_state=state,
            dataloader=dataloader,
            accumulation=accumulation,
        )
        self.handle = enable_adapter(
            self._adapter,
            config=self.config,
            load_fallback=self.load_fallback,
            state=self.state,
            restore_rng=self._defer_rng,
            resumed_step=resumed,
        )
        self.last_start_step = self.handle.start_step
        self.last_recovery = self.handle.last_recovery
        self._stepped = False

    def _check_first_pass(self, max_steps: int, accumulation: int, per_epoch: int | None) -> None:
        """Refuse, before any step, a run whose captures could not all be recovered."""
        interval = self.config.interval
        last = (max_steps // interval) * interval  # the last step captured
        if per_epoch is None or last == 0 or last * accumulation < per_epoch:
            return
        within = (per_epoch - 1) // accumulation
        raise ConfigError(
            f"max_steps={max_steps} with interval={interval}: the capture of step {last} "
            f"lies past the first pass over the data loader ({per_epoch} batches, "
            f"{accumulation} per step), and a callback cannot make the Trainer skip whole "
            f"epochs when it recovers it; train at most {within} steps per train() call "
            "(max_steps) and continue with train(resume_from_checkpoint=<a Trainer "
            "checkpoint>), which ResiliencyCallback leaves to the Trainer"
        )

    def _defer_rng(self, rng: dict[str, Any]) -> None:
        # The Trainer draws from the generators when it creates its data iterator;
        # the captured states are those at the start of the next step.
        self._pending_rng = rng

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self._adapter is not None and self._adapter.boundary is not None
        if self._stepped:
            self._stepped = False
            self._adapter.boundary.after_step()
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self._adapter is not None and self._adapter.boundary is not None
        self._adapter.boundary.before_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stepped = True
        adapter = self._adapter
        if adapter is not None and adapter.skipped_batches and self._per_epoch:
            # The Trainer counts the epoch from the batches after the skipped ones; the
            # uninterrupted run's value (the first pass: epoch 0 plus the batches done).
            state.epoch = (int(state.global_step) * adapter.accumulation) / self._per_epoch

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._adapter is not None and self._adapter.skipped_batches:
            self._adapter.dataloader.skip_batches = 0  # only the first pass skips
            self._adapter.skipped_batches = 0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def make_adapter(obj: Any, optimizers: Sequence[torch.optim.Optimizer], **options: Any) -> Any:
    """``enable_resiliency(trainer)`` is not the Trainer integration: say what is."""
    raise ConfigError(
        "a transformers.Trainer creates its optimizer inside train(); add the callback instead: "
        "trainer.add_callback(lm_resiliency.integrations.hf.ResiliencyCallback(trainer, "
        "interval=10))"
    )

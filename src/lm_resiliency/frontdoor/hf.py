"""Hugging Face ``transformers.Trainer``: a ``TrainerCallback`` that gives the Trainer every tier.

The Trainer's front door (it owns the training loop, so ``enable_resiliency`` cannot
hook it): the callback builds :class:`~lm_resiliency.integrations.hf.HFAdapter` at
train begin and its handle through :func:`~lm_resiliency.frontdoor.enable.enable_adapter`.
Needs the ``hf`` extra.

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

from collections.abc import Callable, Mapping
from typing import Any

from transformers import TrainerCallback

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.frontdoor.enable import enable_adapter
from lm_resiliency.frontdoor.validate import gemini_config
from lm_resiliency.integrations.hf import HFAdapter, dataloader_length
from lm_resiliency.rng import restore_rng

__all__ = ["ResiliencyCallback"]


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
        self.trainer = trainer
        self.config = gemini_config(config, interval)
        self.load_fallback = load_fallback
        self.state = dict(state or {})
        self.handle: Any = None
        self.last_start_step: int | None = None
        """The step the latest ``train()`` began after (0: fresh)."""
        self.last_recovery: Any = None
        """The latest ``train()``'s :class:`~lm_resiliency.frontdoor.resume.RecoveryInfo`."""
        self._adapter: HFAdapter | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._stepped = False
        self._per_epoch: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs["optimizer"]
        torch_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        dataloader = kwargs.get("train_dataloader")
        per_epoch = dataloader_length(dataloader)
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

"""Keep ``Trainer.train()``'s own checkpoint load from undoing ``enable_resiliency``'s restore.

``Trainer.train()`` begins with ``self.checkpointer.load(step=config.checkpoint.load_step)``:
with checkpointing enabled it would load TorchTitan's newest DCP checkpoint
over a GEMINI restore of a newer step (and so train the steps in between
twice), and after the durable fallback it would load the same checkpoint a
second time. ``enable_resiliency(trainer)`` already did that load (GEMINI, or
the DCP checkpointer itself as the durable fallback), so the first one inside
``train()`` must be skipped, and nothing else.

How, without changing TorchTitan: ``BaseCheckpointManager``'s public entry
points (``load``/``save``/``maybe_wait_for_staging``/``close``) return at once
while its public ``enable`` flag is false. :class:`SkipFirstLoad` clears the
flag once recovery is done and sets it back before the first optimizer step
of ``train()`` (``train_step`` calls ``checkpointer.maybe_wait_for_staging()``
just before ``optimizers.step()``, a no-op with nothing staged since the
restart), so the load at the start of ``train()`` is the only call that is
skipped; every ``save`` runs. It also sets it back when the handle closes
(``train()`` with no step left to run).
"""

from __future__ import annotations

import logging
from typing import Any

from lm_resiliency.errors import ConfigError

__all__ = ["SkipFirstLoad", "load_durable"]

log = logging.getLogger(__name__)


def load_durable(trainer: Any) -> int | None:
    """The durable fallback: TorchTitan's own checkpointer loads, as ``train()`` would.

    Runs ``trainer.checkpointer.load(step=config.checkpoint.load_step)`` (every
    rank, collective inside DCP); returns the restored ``trainer.step``, or
    ``None`` when nothing was loaded (checkpointing disabled, or an empty
    checkpoint folder and no ``initial_load_path``).
    """
    loaded = trainer.checkpointer.load(step=trainer.config.checkpoint.load_step)
    return int(trainer.step) if loaded else None


class SkipFirstLoad:
    """Clears ``checkpointer.enable`` until :meth:`restore` (see the module doc)."""

    def __init__(self, checkpointer: Any) -> None:
        if not isinstance(getattr(checkpointer, "enable", None), bool):
            raise ConfigError(
                f"the Trainer's checkpointer ({type(checkpointer).__name__}) has no boolean "
                "'enable' flag; enable_resiliency needs a torchtitan BaseCheckpointManager "
                "(checkpoint.enable=False also works: GEMINI alone, no durable fallback)"
            )
        self._checkpointer = checkpointer
        self._held = False

    def hold(self) -> None:
        """Skip the checkpointer's calls until :meth:`restore` (a no-op when it is disabled)."""
        if self._checkpointer.enable:
            self._checkpointer.enable = False
            self._held = True
            log.info("TorchTitan's checkpoint load at the start of train() is skipped: restored")

    def restore(self) -> None:
        """Give the checkpointer back its calls (idempotent)."""
        if self._held:
            self._checkpointer.enable = True
            self._held = False

"""SCOUT's durable candidates as TorchTitan DCP checkpoints that ``load`` never picks up.

TorchTitan's ``CheckpointManager`` finds the step to resume from by scanning its
``checkpoint.folder`` for names matching ``re.search(r"step-(\\d+)")`` that hold a
``.metadata`` file (``_find_load_step``), and its ``keep_latest_k`` purge scans
with the same pattern. A candidate of step N is therefore written to
``<folder>/scout-candidate-N`` (no ``step-<digits>`` in the name): neither the
discovery nor the purge sees it. Call order (every call on every rank, on the
training thread, at the same step; :class:`~lm_resiliency.integrations.base.DurableCandidates`):

* ``writer(N)``: a synchronous DCP save (``torch.distributed.checkpoint.save``,
  collective over the default group) of exactly what TorchTitan's own save of
  step N holds: the model part's state dict, the ``OptimizersContainer``, and the
  LR schedulers, data position and train state *of the capture of step N*.
  With SCOUT's pipelined verdict the writer runs at the pre-step hook of step N+1,
  when the data loader and ``ntokens_seen`` are already past step N+1's batches and
  ``trainer.step`` is N+1 (the model and optimizer are still step N's), so those
  come from the capture the adapter recorded (:class:`CapturedPosition`), never
  from the live objects. The data position is written in ``ParallelAwareDataloader``'s
  own format (its per-rank pickled ``StatefulDataLoader`` state), which TorchTitan's
  load unpickles; this module never unpickles anything.
* ``verified(N)``: global rank 0 renames the folder to ``<folder>/step-N``, TorchTitan's
  own name, so ``checkpointer.load()`` (the durable fallback) resumes from it like
  from its own save. If TorchTitan already saved ``step-N`` itself (its interval divides
  N), that one is the same state and the candidate is removed.
* ``rejected(N)``: global rank 0 removes the folder. A candidate whose fate never
  came (the job died first) keeps its candidate name: never loaded.

The save completes (DCP's rank 0 writes ``.metadata`` after every rank's data) before
``writer`` returns on every rank, so the rename or removal that follows later never
races with a write. Local or mounted folders only (the rename is ``os.rename``).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.tools import filesystem

from lm_resiliency.errors import ConfigError, ResiliencyError

__all__ = ["CANDIDATE_PREFIX", "CapturedPosition", "DCPCandidates", "dcp_candidates"]

log = logging.getLogger(__name__)

CANDIDATE_PREFIX = "scout-candidate-"
"""A candidate of step N lives in ``<checkpoint.folder>/scout-candidate-N``."""

# TorchTitan's state keys (torchtitan.components.checkpointer.base).
_MODEL, _OPTIMIZER, _LR, _DATA, _TRAIN = (
    "model",
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
)


@dataclass(frozen=True)
class CapturedPosition:
    """What a capture of ``step`` held that the next forward changes (see the module doc)."""

    step: int
    last_epoch: int
    ntokens_seen: int
    dataloader: dict[str, Any]
    """The plain ``StatefulDataLoader`` state (a copy, never modified)."""


class DCPCandidates:
    """The TorchTitan adapter's durable-candidate writer (see the module doc for the order).

    ``position()`` returns the newest capture's :class:`CapturedPosition` (or ``None``).
    """

    def __init__(self, trainer: Any, position: Any) -> None:
        self.trainer = trainer
        self.checkpointer = trainer.checkpointer
        self.folder = os.fspath(self.checkpointer.folder)
        self._position = position

    def path(self, step: int) -> str:
        """Where the candidate of ``step`` is written."""
        return os.path.join(self.folder, f"{CANDIDATE_PREFIX}{step}")

    def __call__(self, step: int) -> None:
        pos = self._position()
        if pos is None or pos.step != step:
            raise ResiliencyError(
                f"TorchTitan durable candidate of step {step}: the newest capture is of step "
                f"{None if pos is None else pos.step}; the candidate must be written at the "
                "capture boundary of its step (before the next capture)"
            )
        with torch.no_grad():
            dcp.save(self._state(pos), checkpoint_id=self.path(step))
        log.info("SCOUT durable candidate of step %d written to %s", step, self.path(step))

    def _state(self, pos: CapturedPosition) -> dict[str, Any]:
        states = self.checkpointer.states
        loader = self.trainer.dataloader
        # TorchTitan's flattened layout (CheckpointManager._flattened_model_states_sd).
        out: dict[str, Any] = {k: v for k, v in states.items() if k not in (_MODEL, _LR, _DATA)}
        out.update(states[_MODEL].state_dict())
        out[_LR] = {**self.trainer.lr_schedulers.state_dict(), "last_epoch": pos.last_epoch}
        rank_id = getattr(loader, "_rank_id", f"dp_rank_{loader.dp_rank}")
        # ParallelAwareDataloader.state_dict()'s format: TorchTitan's load unpickles it.
        out[_DATA] = {rank_id: pickle.dumps(pos.dataloader), "world_size": loader.dp_world_size}
        train = states.get(_TRAIN, self.trainer)  # the Trainer itself in TorchTitan
        out[_TRAIN] = {**train.state_dict(), "step": pos.step, "ntokens_seen": pos.ntokens_seen}
        return out

    def verified(self, step: int) -> None:
        """Make the candidate TorchTitan's ``step-N`` checkpoint (global rank 0)."""
        if dist.get_rank() != 0 or not os.path.isdir(self.path(step)):
            return
        target = os.path.join(self.folder, f"step-{step}")
        if os.path.isfile(os.path.join(target, ".metadata")):
            shutil.rmtree(self.path(step))  # TorchTitan saved this step itself: the same state
        elif os.path.exists(target):
            # TorchTitan's own save of this step without its metadata (an async save still
            # writing, or one that died): neither is touched; the candidate keeps its name.
            log.warning(
                "SCOUT durable candidate of step %d verified but %s exists without .metadata; "
                "the candidate stays at %s",
                step,
                target,
                self.path(step),
            )
            return
        else:
            os.rename(self.path(step), target)
        log.info("SCOUT durable candidate of step %d verified: %s", step, target)

    def rejected(self, step: int) -> None:
        """Remove the candidate (global rank 0): no load can ever find it."""
        if dist.get_rank() == 0:
            shutil.rmtree(self.path(step), ignore_errors=True)
            log.warning("SCOUT durable candidate of step %d rejected and removed", step)


def dcp_candidates(trainer: Any, position: Any) -> DCPCandidates | None:
    """The writer for ``trainer``'s checkpointer, or ``None`` when it never saves.

    ``None`` with TorchTitan's checkpointing disabled or ``load_only`` (``checkpoint.enable``,
    ``checkpoint.load_only`` of the Trainer's config). Raises
    ``ConfigError`` for a checkpointer other than TorchTitan's DCP ``CheckpointManager``
    (its folder layout is what the candidates are named against) or a remote folder.
    """
    ckpt, config = trainer.checkpointer, trainer.config.checkpoint
    if not config.enable:
        log.info("TorchTitan checkpointing is off: SCOUT's durable candidates are not written")
        return None
    if config.load_only:
        log.info("checkpoint.load_only: SCOUT's durable candidates are not written")
        return None
    if not isinstance(ckpt, CheckpointManager):
        raise ConfigError(
            f"the Trainer's checkpointer is a {type(ckpt).__name__}; SCOUT's durable "
            "candidates are DCP checkpoints named against TorchTitan's DCP CheckpointManager "
            "(its step-N folders); use that checkpointer, or ScoutConfig without a catalog"
        )
    if filesystem.is_remote(ckpt.folder):
        raise ConfigError(
            f"checkpoint.folder={ckpt.folder!r} is remote; SCOUT's durable candidates are "
            "promoted by a rename and need a local or mounted folder"
        )
    return DCPCandidates(trainer, position)

"""SCOUT's durable candidates as DeepSpeed checkpoints that ``latest`` names only once verified.

DeepSpeed's ``load_checkpoint(dir)`` (the durable fallback, :func:`.durable_loader`,
with no tag) loads the tag named by the ``dir/latest`` file. Call order (every call on
every rank, on the training thread, at the same step;
:class:`~lm_resiliency.integrations.base.DurableCandidates`):

* ``writer(N)``: ``engine.save_checkpoint(dir, tag="scout-candidate-N",
  save_latest=False)`` (collective; model, ZeRO partitions, optimizer, scheduler,
  counters), so ``latest`` does not move. SCOUT calls it at the step boundary of N
  or, with its pipelined verdict, at the optimizer pre-hook of step N+1: inside
  ``engine.step()`` before the inner optimizer runs, where the masters, optimizer
  state, low-precision parameters, scheduler and counters are all still step N's
  (the engine advances them after the inner step). Not the module's buffers
  (BatchNorm statistics): step N+1's forward changed them in place, so the
  adapter's copies taken at N's boundary are put in for the save and the live
  ones back after it. The engine's ``global_steps`` and the copies must be of
  step N (``ResiliencyError`` otherwise: the writer is not at N's boundary).
* ``verified(N)``: global rank 0 writes ``latest`` = that tag (a temporary file,
  then ``os.replace``), unless ``latest`` already names a newer step
  (``global_step<M>`` or ``scout-candidate-<M>`` with M > N: a newer checkpoint of the
  user's own). The tag keeps its name; ``latest`` naming it is what makes it loadable.
* ``rejected(N)``: global rank 0 removes the tag's folder: nothing loads it, even by
  tag. A candidate whose fate never came (the job died first) stays, never named
  by ``latest``.

DeepSpeed's ``save_checkpoint`` ends with a barrier after every rank wrote its
files, so the ``latest`` update that follows later never names a partial tag.
One folder shared by every rank (not ``use_node_local_storage``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lm_resiliency.capture.buffers import load_persistent_buffers, restore_buffers, save_buffers
from lm_resiliency.errors import ConfigError, ResiliencyError

__all__ = ["CANDIDATE_PREFIX", "CapturedBuffers", "DeepSpeedCandidates", "durable_candidates"]

CapturedBuffers = tuple[int, Any]
"""``(global_steps, persistent_buffers(module))`` of the newest capture."""

log = logging.getLogger(__name__)

CANDIDATE_PREFIX = "scout-candidate-"
"""The tag of the candidate of step N is ``scout-candidate-N``."""

_STEP_TAG = re.compile(r"^(?:global_step|scout-candidate-)(\d+)$")


class DeepSpeedCandidates:
    """The DeepSpeed durable-candidate writer (see the module doc for the order).

    ``buffers()`` returns the newest capture's :data:`CapturedBuffers` (or ``None``).
    """

    def __init__(
        self,
        engine: Any,
        checkpoint_dir: str | os.PathLike[str],
        buffers: Callable[[], CapturedBuffers | None],
    ) -> None:
        self.engine = engine
        self.folder = os.fspath(checkpoint_dir)
        self._buffers = buffers

    @staticmethod
    def tag(step: int) -> str:
        return f"{CANDIDATE_PREFIX}{step}"

    def __call__(self, step: int) -> None:
        at, captured = int(self.engine.global_steps), self._buffers()
        if at != step or captured is None or captured[0] != step:
            raise ResiliencyError(
                f"DeepSpeed durable candidate of step {step}: the engine is at global_steps="
                f"{at}, the newest capture at {None if captured is None else captured[0]}; "
                "the candidate must be written at the boundary of its step"
            )
        module = self.engine.module
        live = save_buffers(module)
        try:
            load_persistent_buffers(module, captured[1], what="DeepSpeed")
            self.engine.save_checkpoint(self.folder, tag=self.tag(step), save_latest=False)
        finally:
            restore_buffers(live)
        log.info("SCOUT durable candidate of step %d written: %s", step, self.tag(step))

    def latest(self) -> str | None:
        """The tag ``latest`` names (what ``load_checkpoint`` without a tag loads), or None."""
        try:
            with open(os.path.join(self.folder, "latest")) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def verified(self, step: int) -> None:
        """Point ``latest`` at the candidate (global rank 0), never back to an older step."""
        if dist.get_rank() != 0 or not os.path.isdir(os.path.join(self.folder, self.tag(step))):
            return
        current = self.latest()
        match = _STEP_TAG.match(current or "")
        if match is not None and int(match.group(1)) > step:
            log.info("SCOUT candidate %d verified; latest stays at the newer %s", step, current)
            return
        tmp = os.path.join(self.folder, f".latest.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(self.tag(step))
        os.replace(tmp, os.path.join(self.folder, "latest"))
        log.info("SCOUT durable candidate of step %d verified: latest = %s", step, self.tag(step))

    def rejected(self, step: int) -> None:
        """Remove the candidate's tag folder (global rank 0)."""
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(self.folder, self.tag(step)), ignore_errors=True)
            log.warning("SCOUT durable candidate of step %d rejected and removed", step)


def durable_candidates(
    engine: Any,
    checkpoint_dir: str | os.PathLike[str],
    buffers: Callable[[], CapturedBuffers | None],
) -> DeepSpeedCandidates:
    """The adapter's writer in ``checkpoint_dir``, the folder of its :func:`.durable_loader`.

    Raises
    ``ConfigError`` when the engine saves node-local checkpoints (``latest`` and the
    removal are done by global rank 0 on one shared folder).
    """
    if engine.use_node_local_storage():
        raise ConfigError(
            "DeepSpeed checkpoint.use_node_local_storage is set; SCOUT's durable candidates "
            "are promoted by global rank 0 in one folder shared by every rank; turn it off or "
            "write candidates with your own save_durable"
        )
    return DeepSpeedCandidates(engine, checkpoint_dir, buffers)

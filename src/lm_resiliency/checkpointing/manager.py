"""InMemoryCheckpointManager: capture -> replicate -> persist -> recover, for one rank.

Call order on every rank (the contract's training loop)::

    manager = InMemoryCheckpointManager(InMemoryCkptConfig(interval=10))
    for step in range(1, max_steps + 1):
        loss = train_step(); loss.backward()
        manager.maybe_wait()          # before the parameters are modified again
        optimizer.step(); optimizer.zero_grad()
        if step % manager.config.interval == 0:
            manager.save(state_dict(), step)
    manager.close()

and on recovery, on every rank: ``step = manager.find_latest()`` then
``state = manager.load(step)``. ``save``, ``maybe_wait`` and ``close`` are
local calls (replication pairs ranks in the background); ``find_latest`` and
``load`` are collective over the manager's process group.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import torch.distributed as dist

from lm_resiliency.capture.engine import CaptureEngine, CaptureStats
from lm_resiliency.capture.slot import Slot
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import NoConsistentStep, ResiliencyError
from lm_resiliency.recovery.select import RecoveryMode, agree_on_step
from lm_resiliency.state import decode_state

log = logging.getLogger(__name__)


class InMemoryCheckpointManager:
    """GEMINI for one rank. Not part of the stable API (see ``enable_resiliency``).

    ``group`` is the process group whose ranks checkpoint together (default:
    the world, when a default group exists; a single-process manager works
    without any process group).
    """

    def __init__(
        self,
        config: InMemoryCkptConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config or InMemoryCkptConfig()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.group = (
            group if group is not None else (dist.group.WORLD if self._distributed else None)
        )
        self.rank = dist.get_rank(self.group) if self._distributed else 0
        self.world_size = dist.get_world_size(self.group) if self._distributed else 1
        self._verified: set[int] = set()
        self._closed = False
        self._engine = CaptureEngine(
            rank=self.rank,
            pin_memory=self.config.pin_memory,
            rate_limit_bytes_per_s=self.config.copy_rate_limit_bytes_per_s,
            after_capture=self._after_capture,
        )

    # ------------------------------------------------------------------ capture
    def save(self, state: Any, step: int) -> None:
        """Launch an asynchronous capture of ``state`` (a state tree) at optimizer ``step``.

        Returns after launching the copy; the cost does not grow with the state's
        bytes. Call :meth:`maybe_wait` before modifying the captured tensors again.
        Waits for the previous capture cycle (copy and replication) first.
        Raises ``StateEncodingError`` (unsupported value, with its key path) and
        ``CaptureError`` (an earlier background failure, with its step).
        """
        self._check_open()
        if not self.config.enable:
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int (the optimizer step)")
        self._engine.capture(state, step)

    def maybe_wait(self) -> None:
        """Wait until the in-flight capture is complete and its replication launched.

        Call before ``optimizer.step()`` (or any change to captured tensors).
        Returns at once when no capture is in flight. Raises ``CaptureError``
        for a failed background capture.
        """
        self._check_open()
        self._engine.wait_captured()

    def _after_capture(self, slot: Slot) -> None:
        """Runs on the completion worker once ``slot`` is complete."""

    # ------------------------------------------------------------------ recovery
    def mark_verified(self, step: int) -> None:
        """Record ``step`` as recovery-verified (normally done by SCOUT certification)."""
        self._verified.add(step)

    def available_steps(self) -> set[int]:
        """Steps of this rank's own state that it can obtain right now."""
        return {s.step for s in self._engine.complete_slots() if s.step is not None}

    def find_latest(self, mode: RecoveryMode = RecoveryMode.LATEST) -> int | None:
        """Collective: the newest step every rank can load, or ``None``.

        Every rank of the manager's group must call it. A newer step present on
        only part of the job is never chosen. ``RecoveryMode.RECOVERY_VERIFIED``
        restricts the choice to verified steps.
        """
        self._check_open()
        self._engine.wait_idle()
        steps = self.available_steps()
        if mode is RecoveryMode.RECOVERY_VERIFIED:
            steps &= self._verified
        return agree_on_step(steps, group=self.group if self._distributed else None)

    def load(self, step: int) -> Any:
        """Collective: this rank's state tree at ``step`` exactly as passed to ``save``.

        Tensors come back as CPU tensors, bit-identical to the captured ones
        (fresh tensors, not views of the manager's arenas). Raises
        ``NoConsistentStep`` when this rank cannot obtain ``step``.
        """
        self._check_open()
        self._engine.wait_idle()
        for slot in self._engine.complete_slots():
            if slot.step == step:
                with slot.reading(step):
                    assert slot.document is not None
                    tensors = [v.clone() for v in slot.views()]
                    return decode_state(slot.document, tensors)
        raise NoConsistentStep(
            f"rank {self.rank} holds no complete capture of step {step}; "
            f"available: {sorted(self.available_steps())}. Call find_latest() first."
        )

    # ------------------------------------------------------------------ lifecycle
    @property
    def stats(self) -> CaptureStats:
        return self._engine.stats

    def slots(self) -> dict[str, Slot]:
        """The slots by contract role name (for tests, logs and the inspect tooling)."""
        roles = {"own_current": self._engine.current}
        prev = self._engine.previous
        if prev is not None:
            roles["own_previous"] = prev
        return roles

    def arena_bytes(self) -> int:
        """Host bytes held by all slots' arenas."""
        return sum(s.arena_bytes for s in self.slots().values())

    def close(self) -> None:
        """Finish in-flight work, stop the workers and free every arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ResiliencyError("this InMemoryCheckpointManager is closed; create a new one")

    def __enter__(self) -> InMemoryCheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""Recovery on enable: the newest common GEMINI step, else the caller's durable fallback.

Collective (every rank of the manager's group, at the same point): ``find_latest``
agrees on the newest step every rank can obtain; ``load`` fetches this rank's
state from its cheapest source and the tree is applied. Without a common
step (or when every candidate fails validation) ``load_fallback()`` runs on
every rank and restores the durable checkpoint itself; the step it returns
must be the same on every rank and becomes the start step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager, RecoveryReport
from lm_resiliency.errors import ConfigError
from lm_resiliency.resiliency._collective import all_gather_ints

__all__ = ["RecoveryInfo", "recover"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryInfo:
    """What ``enable_resiliency`` recovered (``handle.last_recovery``), identical on every rank.

    ``step``: the step training resumes after (``None``: a fresh start);
    ``source``: ``"gemini"``, ``"fallback"`` or ``"fresh"``; ``sources``: each
    rank's source in group-rank order (``"own memory"``, ``"peer disk"``,
    ``"fallback"``, ...); ``seconds``: this rank's wall time for the whole
    recovery (agreement, fetch, apply); ``report``: the manager's
    :class:`RecoveryReport` (bytes moved, phases, walk-back), when it loaded.
    """

    step: int | None
    source: str
    sources: tuple[str, ...]
    seconds: float
    report: RecoveryReport | None


def recover(
    manager: InMemoryCheckpointManager,
    apply: Callable[[Any], int],
    load_fallback: Callable[[], Any] | None,
) -> RecoveryInfo:
    """Run the recovery; ``apply(tree)`` restores a GEMINI tree and returns its step."""
    t0 = time.perf_counter()
    step = manager.find_latest()
    if step is None and load_fallback is None:
        return RecoveryInfo(None, "fresh", ("fresh",) * manager.world_size, _since(t0), None)
    loaded = manager.load(step)
    report = manager.last_recovery
    assert report is not None
    if report.step is not None:
        resumed = apply(loaded)
        return RecoveryInfo(resumed, "gemini", tuple(report.sources), _since(t0), report)
    fallback_step = _check_fallback_step(loaded)
    _agree(manager, fallback_step)
    source = "fallback" if fallback_step is not None else "fresh"
    if step is not None:
        log.warning(
            "GEMINI step %d failed validation on some rank (walked back from %s); "
            "resumed from load_fallback()",
            step,
            report.walked_back_from,
        )
    return RecoveryInfo(fallback_step, source, tuple(report.sources), _since(t0), report)


def _check_fallback_step(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"load_fallback() returned {value!r}; it must restore the durable checkpoint "
            "itself and return the step it restored (an int >= 0) or None for a fresh start"
        )
    return value


def _agree(manager: InMemoryCheckpointManager, step: int | None) -> None:
    if manager.world_size == 1 or not dist.is_initialized():
        return
    steps = all_gather_ints(-1 if step is None else step, manager.group)
    if len(set(steps)) != 1:
        shown = {r: (None if s < 0 else s) for r, s in enumerate(steps)}
        raise ConfigError(
            f"load_fallback() returned different steps on different ranks: {shown}; every "
            "rank must restore the same durable checkpoint step"
        )


def _since(t0: float) -> float:
    return time.perf_counter() - t0

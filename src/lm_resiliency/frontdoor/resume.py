"""Resume on enable: the newest common GEMINI step, else the caller's durable fallback.

Vocabulary, one word per layer: the front door *resumes* training (this module,
:func:`resume`); the manager *restores* a step (:mod:`lm_resiliency.checkpointing.restore`,
``Restorer``, ``RestoreReport``, ``manager.last_restore``); :mod:`lm_resiliency.recovery`
is *recovery*: which step every rank can obtain and the fetch of it; SCOUT makes the
*recovery decision* (:func:`~lm_resiliency.detection.decision.decide_recovery`). What the
user reads back is ``handle.last_recovery`` (:class:`RecoveryInfo`), the whole story.

Collective (every rank of the manager's group, at the same point): ``find_latest``
agrees on the newest step every rank can obtain; ``load`` fetches this rank's
state from its cheapest source and the tree is applied. Without a common
step (or when every candidate fails validation) ``load_fallback()`` runs on
every rank and restores the durable checkpoint itself; the step it returns
must be the same on every rank and becomes the start step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager, RestoreReport
from lm_resiliency.detection import RecoveryDecision, Scout, decide_recovery
from lm_resiliency.errors import ConfigError

__all__ = ["RecoveryInfo", "resume", "resume_from_framework"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryInfo:
    """What ``enable_resiliency`` recovered (``handle.last_recovery``), identical on every rank.

    ``step``: the step training resumes after (``None``: a fresh start);
    ``source``: ``"gemini"``, ``"fallback"``, ``"fresh"`` or ``"heal"`` (live membership: a
    restarted replica healed from a member's state, docs/live-membership.md §6); ``sources``: each
    rank's source in group-rank order (``"own memory"``, ``"peer disk"``,
    ``"fallback"``, ...); ``seconds``: this rank's wall time for the whole
    recovery (agreement, fetch, apply); ``report``: the manager's
    :class:`RestoreReport` (bytes moved, phases, walk-back), when it loaded.
    """

    step: int | None
    source: str
    sources: tuple[str, ...]
    seconds: float
    report: RestoreReport | None
    decision: RecoveryDecision | None = None
    """SCOUT's recovery decision (failure kind, mode, reason), when SCOUT is enabled."""


def resume(
    manager: InMemoryCheckpointManager,
    apply: Callable[[Any], int],
    load_fallback: Callable[[], Any] | None,
    *,
    scout: Scout | None = None,
    failure_kind: str | None = None,
) -> RecoveryInfo:
    """Resume: restore the chosen step; ``apply(tree)`` restores a GEMINI tree and returns its step.

    With ``scout`` the recovery mode follows the failure kind (SCOUT's
    decision table, ``decide_recovery``): a detected SDC (also one SCOUT
    persisted before the restart) or an inaccessible machine recovers the newest
    ``RECOVERY_VERIFIED`` step; an accessible straggler the latest; a hang or
    unknown failure sweeps SCOUT's catalog over the latest step and keeps it
    only after a complete clean sweep.
    """
    t0 = time.perf_counter()
    if scout is not None:
        return _resume_decided(manager, apply, load_fallback, scout, failure_kind, t0)
    step = manager.find_latest()
    if step is None and load_fallback is None:
        return RecoveryInfo(None, "fresh", ("fresh",) * manager.world_size, _since(t0), None)
    loaded = manager.load(step)
    return _applied(manager, apply, loaded, step, t0)


def resume_from_framework(manager: InMemoryCheckpointManager, step: int) -> RecoveryInfo:
    """The framework restored its own durable checkpoint of ``step``: no GEMINI recovery."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"resumed_step={step!r} must be the restored step (an int >= 0)")
    _agree(manager, step)
    log.info("resumed from the framework's own checkpoint of step %d; no GEMINI recovery", step)
    return RecoveryInfo(step, "fallback", ("fallback",) * manager.world_size, 0.0, None)


def _resume_decided(
    manager: InMemoryCheckpointManager,
    apply: Callable[[Any], int],
    load_fallback: Callable[[], Any] | None,
    scout: Scout,
    failure_kind: str | None,
    t0: float,
) -> RecoveryInfo:
    applied: dict[str, Any] = {}

    def load_latest(step: int) -> None:
        # The sweep replays the state it is about to certify, so apply it first.
        applied["tree"] = manager.load(step)
        applied["step"] = manager.last_restore.step if manager.last_restore else None
        if applied["step"] is not None:
            apply(applied["tree"])

    decision = decide_recovery(
        manager, failure_kind=failure_kind, scout=scout, load_latest=load_latest
    )
    log.info(
        "recovery decision: %s -> %s step %s (%s)",
        decision.failure_kind.value,
        decision.mode.value,
        decision.step,
        decision.reason,
    )
    if decision.step is not None and applied.get("step") == decision.step:
        report = manager.last_restore
        assert report is not None
        return RecoveryInfo(
            decision.step, "gemini", tuple(report.sources), _since(t0), report, decision
        )
    if decision.step is None and load_fallback is None:
        return RecoveryInfo(
            None, "fresh", ("fresh",) * manager.world_size, _since(t0), None, decision
        )
    loaded = manager.load(decision.step, mode=decision.mode)
    info = _applied(manager, apply, loaded, decision.step, t0)
    return dataclasses.replace(info, decision=decision)


def _applied(
    manager: InMemoryCheckpointManager,
    apply: Callable[[Any], int],
    loaded: Any,
    step: int | None,
    t0: float,
) -> RecoveryInfo:
    report = manager.last_restore
    assert report is not None
    if report.step is not None:
        step_applied = apply(loaded)
        return RecoveryInfo(step_applied, "gemini", tuple(report.sources), _since(t0), report)
    fallback_step = _agree(manager, loaded)
    source = "fallback" if fallback_step is not None else "fresh"
    if step is not None:
        log.warning(
            "GEMINI step %d failed validation on some rank (walked back from %s); "
            "resumed from load_fallback()",
            step,
            report.walked_back_from,
        )
    # load_fallback() found nothing (returned None): every rank starts fresh, say so per rank.
    sources = tuple(report.sources)
    if fallback_step is None:
        sources = ("fresh",) * len(sources)
    return RecoveryInfo(fallback_step, source, sources, _since(t0), report)


def _check_fallback_step(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"load_fallback() returned {value!r}; it must restore the durable checkpoint "
            "itself and return the step it restored (an int >= 0) or None for a fresh start"
        )
    return value


def _agree(manager: InMemoryCheckpointManager, loaded: Any) -> int | None:
    """The fallback step, checked and compared on every rank over the bounded control plane.

    A value refused on one rank is a ``ConfigError`` on every rank (naming it), and
    different steps on different ranks are a ``ConfigError`` on every rank.
    """
    control = manager.control
    step = control.agree(lambda: _check_fallback_step(loaded), "check the load_fallback() step")
    steps = control.all_gather_ints(-1 if step is None else step, name="agree the fallback step")
    if len(set(steps)) != 1:
        shown = {r: (None if s < 0 else s) for r, s in enumerate(steps)}
        raise ConfigError(
            f"load_fallback() returned different steps on different ranks: {shown}; every "
            "rank must restore the same durable checkpoint step"
        )
    return step


def _since(t0: float) -> float:
    return time.perf_counter() - t0

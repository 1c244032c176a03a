"""Which step to recover, by failure kind: :func:`decide_recovery` and the decision table.

Vocabulary: SCOUT makes the *recovery decision* (:class:`RecoveryDecision`); the manager
then *restores* the step it names (:mod:`lm_resiliency.checkpointing.restore`).

=====================================  ==========================================
failure kind                           recovery
=====================================  ==========================================
``sdc`` (detected, or a persisted      the persisted ``RECOVERY_VERIFIED`` step
SCOUT verdict on any rank)
``inaccessible`` (a machine is lost)   the persisted ``RECOVERY_VERIFIED`` step
``straggler`` (all ranks accessible)   the latest step (``LATEST``)
``hang`` / ``unknown`` (all ranks      SCOUT replays the full catalog: a complete
accessible)                            clean sweep -> latest; SDC, missing
                                       evidence or an incomplete sweep -> verified
=====================================  ==========================================

The failure kind comes from, in order: the ``failure_kind`` argument, the
environment variable ``LM_RESILIENCY_FAILURE_KIND`` (set by an orchestrator:
``sdc``, ``inaccessible``, ``straggler``, ``hang`` or ``unknown``), else
``unknown``. A SCOUT verdict persisted in any rank's trust records overrides
any of them with ``sdc``: a job restarted after an SDC recovers in verified
mode without being told. Ranks that were told different kinds use the most
conservative one.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from lm_resiliency.detection.result import ScoutResult
from lm_resiliency.errors import ConfigError
from lm_resiliency.persistence.trust import RecoveryVerdict
from lm_resiliency.recovery.mode import RecoveryMode

FAILURE_KIND_ENV = "LM_RESILIENCY_FAILURE_KIND"


class FailureKind(str, enum.Enum):
    """Why the job is recovering (from the orchestrator, SCOUT's verdict, or unknown)."""

    SDC = "sdc"
    INACCESSIBLE = "inaccessible"
    STRAGGLER = "straggler"
    HANG = "hang"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: FailureKind | str, *, where: str) -> FailureKind:
        try:
            return cls(value)
        except ValueError:
            kinds = ", ".join(k.value for k in cls)
            raise ConfigError(
                f"{where}={value!r} is not a failure kind; use one of {kinds}"
            ) from None


# Most conservative first: when ranks disagree, the first one any rank names wins.
_SEVERITY = [
    FailureKind.SDC,
    FailureKind.INACCESSIBLE,
    FailureKind.HANG,
    FailureKind.UNKNOWN,
    FailureKind.STRAGGLER,
]


@dataclass(frozen=True)
class RecoveryDecision:
    """The recovery mode and step chosen for a failure kind, and why (same on every rank)."""

    failure_kind: FailureKind
    mode: RecoveryMode
    step: int | None
    """The step to load in ``mode`` (``None``: no GEMINI step; use the framework fallback)."""
    source: str
    """Where the failure kind came from: ``argument``, ``environment``, ``persisted
    verdict`` or ``default``."""
    reason: str
    sweep: ScoutResult | None = None
    """The full-catalog sweep, for a hang or unknown failure."""


def decide_mode(kind: FailureKind, sweep: ScoutResult | None) -> tuple[RecoveryMode, str]:
    """The decision table (pure): the mode for ``kind`` and the sweep's result, and why."""
    if kind in (FailureKind.SDC, FailureKind.INACCESSIBLE):
        what = "silent data corruption" if kind is FailureKind.SDC else "an inaccessible machine"
        return RecoveryMode.RECOVERY_VERIFIED, f"{what}: recover the persisted verified step"
    if kind is FailureKind.STRAGGLER:
        return RecoveryMode.LATEST, "an accessible straggler: the latest state is sound"
    if sweep is None:
        return RecoveryMode.RECOVERY_VERIFIED, f"{kind.value}: no SCOUT sweep (missing evidence)"
    if sweep.status.corrupt:
        return RecoveryMode.RECOVERY_VERIFIED, f"{kind.value}: the sweep found {sweep.reason}"
    if not sweep.complete_cycle:
        return RecoveryMode.RECOVERY_VERIFIED, f"{kind.value}: {sweep.reason}"
    return RecoveryMode.LATEST, f"{kind.value}: a complete clean sweep of the catalog"


class _Verdicts(Protocol):
    def recovery_verdict(self) -> RecoveryVerdict | None: ...


class _Manager(Protocol):
    """What the decision needs from GEMINI: ``find_latest`` and its trust ledger."""

    def find_latest(self, mode: RecoveryMode = RecoveryMode.LATEST) -> int | None: ...

    @property
    def trust(self) -> _Verdicts: ...


class _Sweeper(Protocol):
    def sweep(
        self, step: int = 0, *, warmup: Callable[[], object] | None = None
    ) -> ScoutResult: ...

    def recovered(self, step: int, *, verified: bool) -> None: ...


def _agree(kind: FailureKind, has_verdict: bool) -> tuple[FailureKind, bool]:
    if not (dist.is_available() and dist.is_initialized()):
        return kind, has_verdict
    mine = torch.tensor([_SEVERITY.index(kind), int(has_verdict)], dtype=torch.int64)
    pg = dist.new_group(backend="gloo")  # a CPU group even beside NCCL training
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=pg)
    dist.destroy_process_group(pg)
    worst = min(int(t[0]) for t in out)
    return _SEVERITY[worst], any(int(t[1]) for t in out)


def decide_recovery(
    manager: _Manager,
    *,
    failure_kind: FailureKind | str | None = None,
    scout: _Sweeper | None = None,
    load_latest: Callable[[int], None] | None = None,
    warmup: Callable[[], object] | None = None,
    env: Mapping[str, str] | None = None,
) -> RecoveryDecision:
    """Collective: the failure kind agreed by every rank, the mode and step to recover.

    Call on every rank before ``manager.load``. For a hang or unknown failure
    with ``scout``, the latest step is first applied with ``load_latest(step)``
    (the caller loads it into the model, on every rank; without it the sweep
    runs on the model's current state, as in a job that is still alive), then
    the catalog is swept on it (a restarted process replays the catalog saved with the
    trust records; ``warmup`` runs one forward where none was saved); a clean complete
    sweep keeps it, anything else chooses the verified step, which the caller then
    loads. Raises ``ConfigError`` for an unknown failure kind.
    """
    environ = os.environ if env is None else env
    if failure_kind is not None:
        kind, source = FailureKind.parse(failure_kind, where="failure_kind"), "argument"
    elif environ.get(FAILURE_KIND_ENV):
        kind = FailureKind.parse(environ[FAILURE_KIND_ENV], where=FAILURE_KIND_ENV)
        source = "environment"
    else:
        kind, source = FailureKind.UNKNOWN, "default"
    verdict = manager.trust.recovery_verdict()
    kind, any_verdict = _agree(kind, verdict is not None)
    if any_verdict:
        kind, source = FailureKind.SDC, "persisted verdict"
    sweep: ScoutResult | None = None
    if kind in (FailureKind.HANG, FailureKind.UNKNOWN) and scout is not None:
        latest = manager.find_latest(RecoveryMode.LATEST)
        if latest is not None:
            if load_latest is not None:
                load_latest(latest)
            sweep = scout.sweep(latest, warmup=warmup)
    mode, reason = decide_mode(kind, sweep)
    if any_verdict:
        shown = verdict.reason if verdict is not None else "on another rank"
        reason = f"{reason} (SCOUT verdict: {shown})"
    step = manager.find_latest(mode)
    if scout is not None and step is not None:
        scout.recovered(step, verified=mode is RecoveryMode.RECOVERY_VERIFIED)
    return RecoveryDecision(kind, mode, step, source, reason, sweep)

"""MTGSConfig: every knob of the step transaction, validated when constructed."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from lm_resiliency._validate import Rule, at_least, validate
from lm_resiliency.errors import ConfigError


class ExhaustedPolicy(enum.Enum):
    """What :meth:`MTGS.step` does when a step still fails after ``max_retries`` retries."""

    RAISE = "raise"
    """Raise :class:`~lm_resiliency.errors.StepAborted` on every rank (the default)."""
    SKIP = "skip"
    """Discard the step on every rank and return ``StepResult(committed=False)``."""


@dataclass(frozen=True, kw_only=True)
class MTGSConfig:
    """Configuration of :class:`~lm_resiliency.transactions.MTGS`.

    Keyword-only; raises ``ConfigError`` naming the field when a value is invalid.
    """

    max_retries: int = 2
    """Retries of an aborted step (same batch, same RNG) before ``on_exhausted`` applies."""

    vote_in_hook: bool = True
    """Fold each rank's health code into the gradient all-reduce the DDP comm hook already
    runs: zero extra collectives. ``False`` registers no comm hook (DDP's built-in all-reduce,
    or a hook the user registers) and adds one explicit vote all-reduce per step (the
    ``--mtgs-disable-hook`` ablation)."""

    shadow: bool = True
    """Copy the pre-step state (parameters, optimizer, scheduler, scaler) to host memory in
    the background during forward/backward, so a fault during or after ``optimizer.step()``
    is rolled back instead of ending the job (``--mtgs-disable-shadow``)."""

    two_phase_commit: bool = True
    """After ``optimizer.step()`` and the post-step checks, agree that every rank applied the
    update: one all-reduce of ``world_size`` int32 per step. Without it a rank whose update
    failed repairs itself from its shadow (re-running ``optimizer.step()`` on the same
    reduced gradients) and the other ranks never learn of it (``--mtgs-disable-2pc``)."""

    check_params_finite: bool = True
    """After ``optimizer.step()``, check that every parameter is finite (one fused pass)."""

    force_abort_steps: frozenset[int] = field(default_factory=frozenset)
    """Steps (1-based) whose first attempt every rank votes to abort; for tests and demos
    (``--mtgs-force-abort-step``). The retry of such a step commits normally."""

    collective_timeout_s: float = 60.0
    """Bound on the collectives MTGS issues itself (explicit vote, commit confirmation).
    The gradient all-reduce inside DDP is bounded by the process group's own timeout."""

    on_exhausted: ExhaustedPolicy = ExhaustedPolicy.RAISE
    """``RAISE``: ``StepAborted`` after the last retry; ``SKIP``: drop the step and go on."""

    pin_shadow: bool = True
    """Allocate the shadow arena page-locked when CUDA is present (faster device copies)."""

    min_memory_headroom: float = 0.0
    """The share of memory that must stay free on this rank, checked before the synchronised
    backward pass: on CUDA free over total device memory, on CPU one minus the process RSS
    over the cgroup's memory limit (no limit: no check). Below it the rank votes
    ``LOW_MEMORY`` and the step is retried after the allocator cache is emptied. 0 (the
    default) disables the check."""

    memory_limit_bytes: int | None = None
    """The CPU memory limit the RSS is measured against, instead of the cgroup's (a host whose
    limit is enforced outside the cgroup). ``None``: the cgroup's limit."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "force_abort_steps", _steps(self.force_abort_steps))
        validate(self, _RULES, prefix="MTGSConfig.")


#: Range rules per field (the type comes from the annotation; see ``lm_resiliency._validate``).
_RULES = {
    "max_retries": at_least(0, "must be >= 0 (0: no retry)", "max_retries=2"),
    "collective_timeout_s": Rule(
        lambda v: v > 0, "must be a finite number of seconds > 0, e.g. 60", "60"
    ),
    "min_memory_headroom": Rule(
        lambda v: 0 <= v < 1,
        "must be a fraction in [0, 1) (0: no memory check)",
        "min_memory_headroom=0.05",
    ),
    "memory_limit_bytes": at_least(1, "must be a byte count >= 1", "memory_limit_bytes=2**34"),
}


def _steps(value: Iterable[int] | int) -> frozenset[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"MTGSConfig.force_abort_steps={value!r} must be a set of step numbers, e.g. {{2}}"
        )
    steps = frozenset(value)
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(
                f"MTGSConfig.force_abort_steps contains {s!r}; steps are ints >= 1 "
                "(the first step is 1)"
            )
    return steps

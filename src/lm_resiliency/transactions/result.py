"""What one transactional step did: committed or not, attempts, why attempts were aborted."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AbortRecord:
    """One aborted attempt of a step, identical on every rank.

    ``phase`` is ``"vote"`` (decided before ``optimizer.step()``: nothing to
    restore) or ``"commit"`` (the update failed on some rank: the shadow was
    restored). ``reasons`` maps each unhealthy rank to its reason names.
    ``ettr_ns`` is this rank's time from detection to ready-to-retry.
    """

    attempt: int
    phase: str
    reasons: dict[int, tuple[str, ...]]
    ettr_ns: int


@dataclass(frozen=True)
class MembershipChange:
    """A membership change one attempt of a step went through (live mode), same on survivors.

    ``operation`` is the collective that failed; ``epoch``/``members`` the membership the
    step went on with; ``outcome`` is ``"finalised"`` (another survivor confirmed the step:
    this rank kept its update), ``"restored"`` (this rank rolled its update back from the
    shadow; the step is redone) or ``"redo"`` (nothing was applied; the step is redone).
    ``reform_ns`` is the time in ``Reducer.reform`` (ack, agreement, group rebuild);
    ``ettr_ns`` from detection to ready-to-redo.
    """

    attempt: int
    operation: str
    cause: str
    old_epoch: int
    epoch: int
    members: tuple[int, ...]
    resume_step: int
    outcome: str
    reform_ns: int
    ettr_ns: int


@dataclass(frozen=True)
class StepResult:
    """Outcome of :meth:`MTGS.step`.

    ``committed`` is ``False`` only under ``ExhaustedPolicy.SKIP``; ``attempts``
    counts every try (1 = no abort); ``loss`` is the committed attempt's loss
    (detached), ``None`` if no attempt committed; ``recovery_ns`` sums the ETTR
    of the aborts; ``step_ns`` is the wall time of the whole step.
    """

    step: int
    committed: bool
    attempts: int
    aborts: tuple[AbortRecord, ...]
    loss: torch.Tensor | None
    recovery_ns: int
    step_ns: int
    membership_changes: tuple[MembershipChange, ...] = ()
    """Live mode: the membership changes this step went through (each redid the step)."""

    @property
    def retries(self) -> int:
        """Attempts after the first."""
        return self.attempts - 1

    @property
    def reasons(self) -> dict[int, tuple[str, ...]]:
        """Every rank that caused an abort in this step, with all its reason names."""
        out: dict[int, list[str]] = {}
        for record in self.aborts:
            for rank, names in record.reasons.items():
                seen = out.setdefault(rank, [])
                seen.extend(n for n in names if n not in seen)
        return {rank: tuple(names) for rank, names in sorted(out.items())}

"""From one check's assessment (every group's verdicts) to its :class:`ScoutResult`."""

from __future__ import annotations

from dataclasses import replace

from lm_resiliency.detection.assess import Assessment, describe_groups
from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.result import ScoutResult, ScoutStatus, Straggler
from lm_resiliency.detection.verdict import Outcome
from lm_resiliency.detection.wire import CLASSES

_ORDER = [ScoutStatus.HEALTHY, ScoutStatus.STRAGGLER, ScoutStatus.INCONCLUSIVE, ScoutStatus.SDC]


def severity(status: ScoutStatus) -> int:
    """Healthy < straggler < inconclusive < SDC."""
    return _ORDER.index(status)


def compose(
    step: int,
    a: Assessment,
    groups: ComparisonGroups,
    *,
    labels: list[str],
    timings: dict[str, float],
    bytes_exchanged: int,
    rerun: bool,
    cycle: bool,
) -> ScoutResult:
    """The job-wide result: status, faulty ranks, stragglers, whether a capture may follow.

    A capture needs evidence: every group must have compared at least one class
    clean (a check whose recipes all gave no evidence permits no capture, and is
    no alarm either).
    """
    g = groups.groups
    sdc = a.outcomes(Outcome.SDC)
    inconclusive = a.outcomes(Outcome.INCONCLUSIVE)
    stragglers = tuple(
        Straggler(rank, round(s, 3), t, med) for rank, (s, t, med) in sorted(a.suspects.items())
    )
    reasons: list[str] = []
    for gi, name in sdc:
        v = a.verdicts[(gi, name)]
        reasons.append(f"group {list(g[gi])} {name}: SDC on ranks {list(v.faulty)} ({v.detail})")
    for gi, name in inconclusive:
        v = a.verdicts[(gi, name)]
        reasons.append(f"group {list(g[gi])} {name}: inconclusive ({v.detail})")
    evidence = all(
        any(a.verdicts[(gi, n)].outcome is Outcome.CLEAN for n in CLASSES) for gi in a.groups()
    )
    if sdc:
        status = ScoutStatus.SDC
    elif inconclusive:
        status = ScoutStatus.INCONCLUSIVE
    elif stragglers:
        status = ScoutStatus.STRAGGLER
    else:
        status = ScoutStatus.HEALTHY
    if not evidence and not status.corrupt:
        reasons.append("no recipe produced evidence in some group: the capture waits")
    for gi, name in a.outcomes(Outcome.NONDETERMINISTIC):
        reasons.append(f"group {list(g[gi])} {name}: {a.verdicts[(gi, name)].detail}")
    return ScoutResult(
        step=step,
        status=status,
        faulty_ranks=a.faulty(),
        stragglers=stragglers,
        recipe=" ".join(labels),
        timings=timings,
        bytes_exchanged=bytes_exchanged,
        capture_allowed=evidence and not status.corrupt,
        reason="; ".join(reasons),
        rerun=rerun,
        complete_cycle=cycle,
        groups=describe_groups(a, groups),
    )


def blocked(result: ScoutResult, why: str) -> ScoutResult:
    """``result`` with its capture refused because SCOUT is latched (``why``)."""
    reason = f"{result.reason}; " if result.reason else ""
    return replace(result, capture_allowed=False, reason=f"{reason}latched: {why}")

"""Judging one recipe class in one comparison group, and finding stragglers.

Comparison is exact (64-bit digests). With three or more participating peers a
strict majority names the faulty rank(s); with two, a mismatch cannot say which
rank is wrong and is *inconclusive* (treated as SDC by certification).

With a confirmation re-run, a rank whose two replays differ is *unstable*. When
every participant is stable the first round decides. When some are unstable, a
stable strict majority that agrees in both rounds still names the others faulty
(peers reproduce the compute, that rank cannot); without one, the recipe is
*nondeterministic* on this device and yields no evidence (never an alarm).
"""

from __future__ import annotations

import enum
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from lm_resiliency.detection.wire import ClassReport, RunState

_ERROR_DIGEST = -1  # a failed replay counts as one more distinct value


class Outcome(enum.Enum):
    """A group's verdict for one recipe class."""

    CLEAN = "clean"
    """Every participant computed the same digest."""
    SDC = "sdc"
    """A strict majority agrees; the others are faulty."""
    INCONCLUSIVE = "inconclusive"
    """A mismatch without a strict majority (always so with two peers)."""
    NO_EVIDENCE = "no_evidence"
    """Nothing was compared (class not run, no recorded shape, every replay failed)."""
    NONDETERMINISTIC = "nondeterministic"
    """Replays were not reproducible on most peers: no evidence, no alarm."""


@dataclass(frozen=True)
class GroupVerdict:
    outcome: Outcome
    faulty: tuple[int, ...] = ()
    detail: str = ""


def _value(c: ClassReport) -> int:
    return c.digest if c.state is RunState.OK else _ERROR_DIGEST


def _participants(reports: Mapping[int, ClassReport]) -> dict[int, int] | None:
    ran = {r: _value(c) for r, c in reports.items() if c.state in (RunState.OK, RunState.ERROR)}
    if ran and len(ran) != len(reports):
        return None  # some peers did not run what the source asked: a disagreement
    return ran


def _majority(values: Mapping[int, int]) -> tuple[int, int] | None:
    (value, count), *_ = Counter(values.values()).most_common(1)
    return (value, count) if count * 2 > len(values) else None


def judge(
    first: Mapping[int, ClassReport], second: Mapping[int, ClassReport] | None = None
) -> GroupVerdict:
    """The verdict of one class in one group from each rank's report (rank -> report)."""
    ran = _participants(first)
    if ran is None:
        return GroupVerdict(Outcome.INCONCLUSIVE, detail="peers replayed different recipes")
    if not ran:
        return GroupVerdict(Outcome.NO_EVIDENCE, detail="not run")
    if all(v == _ERROR_DIGEST for v in ran.values()):
        return GroupVerdict(Outcome.NO_EVIDENCE, detail="the replay failed on every peer")
    if len(set(ran.values())) == 1 and second is None:
        return GroupVerdict(Outcome.CLEAN)
    values = ran
    if second is not None:
        again = _participants(second) or {}
        unstable = {r for r, v in ran.items() if again.get(r) != v}
        if unstable:
            stable = {r: v for r, v in ran.items() if r not in unstable}
            top = _majority(stable) if stable else None
            if top is None or top[1] * 2 <= len(ran):
                return GroupVerdict(
                    Outcome.NONDETERMINISTIC,
                    detail=f"replays not reproducible on ranks {sorted(unstable)}",
                )
            faulty = tuple(sorted(r for r in ran if r in unstable or ran[r] != top[0]))
            return GroupVerdict(Outcome.SDC, faulty, "faulty ranks could not reproduce")
        if len(set(values.values())) == 1:
            return GroupVerdict(Outcome.CLEAN)
    if len(values) < 3:
        return GroupVerdict(
            Outcome.INCONCLUSIVE,
            detail=f"{len(values)} peers disagree; no majority can name the faulty rank",
        )
    top = _majority(values)
    if top is None:
        return GroupVerdict(Outcome.INCONCLUSIVE, detail="no strict majority among the digests")
    faulty = tuple(sorted(r for r, v in values.items() if v != top[0]))
    return GroupVerdict(Outcome.SDC, faulty, f"majority of {top[1]}/{len(values)} peers")


@dataclass(frozen=True)
class StragglerRule:
    mad_factor: float
    floor_s: float
    min_slowdown: float


def straggler_suspects(times: Mapping[int, float], rule: StragglerRule) -> dict[int, float]:
    """Ranks slower than their peers' median by a robust margin: rank -> slowdown.

    For each rank, the reference is the median of the *other* ranks' times and
    the spread their median absolute deviation (scaled by 1.4826): a rank is a
    suspect when it exceeds the median by ``max(mad_factor * spread, floor_s)``
    and by a factor of at least ``min_slowdown``.
    """
    out: dict[int, float] = {}
    if len(times) < 2:
        return out
    for rank, t in times.items():
        others = [v for r, v in times.items() if r != rank]
        med = statistics.median(others)
        spread = 1.4826 * statistics.median(abs(v - med) for v in others)
        if med <= 0:
            continue
        if t > med + max(rule.mad_factor * spread, rule.floor_s) and t >= rule.min_slowdown * med:
            out[rank] = t / med
    return out

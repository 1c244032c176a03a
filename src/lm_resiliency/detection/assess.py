"""From a comparison group's reports to its picture of one check round.

Pure functions of the reports all-gathered inside one comparison group: every
member of the group computes the same :class:`Assessment`. What the job must
agree on beyond that (SDC anywhere, a cycle complete everywhere) is one small
all-reduce of flags (:class:`~lm_resiliency.detection.wire.Flags`).

``reports`` map global ranks to their :class:`RankReport` (a list indexed by
rank is accepted too); only the groups whose ranks are all present are judged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.verdict import (
    GroupVerdict,
    Outcome,
    StragglerRule,
    judge,
    straggler_suspects,
)
from lm_resiliency.detection.wire import CLASSES, RankReport, RunState
from lm_resiliency.errors import ResiliencyError

#: Ranks a straggler cohort needs (replays of one recipe compared inside a group).
_MIN_COHORT = 3

SHORT = {"dense": "dense", "optimizer": "opt", "dynamic": "dyn"}


@dataclass
class Assessment:
    """Verdicts per (group index, class), straggler suspects (rank -> (slowdown, s, median))."""

    verdicts: dict[tuple[int, str], GroupVerdict] = field(default_factory=dict)
    suspects: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    def anomalies(self) -> bool:
        """A mismatch or a straggler suspect: what a confirmation re-run is for."""
        bad = {Outcome.SDC, Outcome.INCONCLUSIVE}
        return bool(self.suspects) or any(v.outcome in bad for v in self.verdicts.values())

    def faulty(self) -> tuple[int, ...]:
        return tuple(sorted({r for v in self.verdicts.values() for r in v.faulty}))

    def groups(self) -> list[int]:
        """The indices of the groups judged (a rank judges its own group)."""
        return judged(self)

    def outcomes(self, outcome: Outcome) -> list[tuple[int, str]]:
        return sorted(k for k, v in self.verdicts.items() if v.outcome is outcome)


Reports = Mapping[int, RankReport] | Sequence[RankReport]


def as_map(reports: Reports) -> Mapping[int, RankReport]:
    """``reports`` keyed by global rank."""
    return reports if isinstance(reports, Mapping) else dict(enumerate(reports))


def present(groups: ComparisonGroups, reports: Mapping[int, RankReport]) -> list[int]:
    """The indices of the groups whose every rank has a report here."""
    return [gi for gi, g in enumerate(groups.groups) if all(r in reports for r in g)]


def judged(a: Assessment) -> list[int]:
    """The indices of the groups ``a`` holds verdicts for."""
    return sorted({gi for gi, _ in a.verdicts})


def check_consistent(reports: Reports, groups: ComparisonGroups) -> None:
    """Raise ``ResiliencyError`` (in the group alike) if ranks are not in the same check."""
    reports = as_map(reports)
    seqs = {(r.seq, r.step) for r in reports.values()}
    if len(seqs) != 1:
        raise ResiliencyError(
            f"SCOUT ranks are at different checks (sequence, step): {sorted(seqs)[:4]}; every "
            "rank must call check/before_capture at the same steps"
        )
    for gi in present(groups, reports):
        g = groups.groups[gi]
        fps = {reports[r].fingerprint for r in g}
        if len(fps) != 1:
            raise ResiliencyError(
                f"SCOUT peers {list(g)} no longer run the same configuration (torch threads, "
                "version or model structure changed on some rank); their replays cannot be compared"
            )


def assess(
    first: Reports,
    groups: ComparisonGroups,
    rule: StragglerRule,
    second: Reports | None = None,
) -> Assessment:
    """Judge every class in every present group; straggler suspects (both rounds if given)."""
    out = Assessment()
    first = as_map(first)
    second = None if second is None else as_map(second)
    for gi in present(groups, first):
        ranks = groups.groups[gi]
        for name in CLASSES:
            a = {r: first[r].of(name) for r in ranks}
            b = None if second is None else {r: second[r].of(name) for r in ranks}
            out.verdicts[(gi, name)] = judge(a, b)
    out.suspects = _suspects(first, rule)
    if second is not None:
        again = _suspects(second, rule)
        confirmed = {}
        for rank, (slow, t, med) in out.suspects.items():
            if rank in again:
                slow2, t2, med2 = again[rank]
                confirmed[rank] = (slow, t, med) if slow <= slow2 else (slow2, t2, med2)
        out.suspects = confirmed
    return out


def _suspects(
    reports: Mapping[int, RankReport], rule: StragglerRule
) -> dict[int, tuple[float, float, float]]:
    # Cohorts: ranks that replayed the same recipe on the same shapes (of the reports here).
    cohorts: dict[tuple[str, int, int, int], dict[int, float]] = defaultdict(dict)
    for rank, rep in sorted(reports.items()):
        for name in ("dense", "dynamic"):
            c = rep.of(name)
            if c.state is RunState.OK:
                cohorts[(name, c.recipe, c.extra, c.signature)][rank] = c.seconds
    worst: dict[int, tuple[float, float, float]] = {}
    for times in cohorts.values():
        if len(times) < _MIN_COHORT:
            continue  # one peer is no reference: either of two could be the slow one
        for rank, slowdown in straggler_suspects(times, rule).items():
            med = times[rank] / slowdown
            if rank not in worst or slowdown > worst[rank][0]:
                worst[rank] = (slowdown, times[rank], med)
    return worst


def describe_groups(a: Assessment, groups: ComparisonGroups) -> tuple[str, ...]:
    """One line per judged group: ``[0, 1, 2] dense=clean opt=clean`` (classes that ran)."""
    lines = []
    for gi in judged(a):
        ranks = groups.groups[gi]
        parts = [
            f"{SHORT[n]}={a.verdicts[(gi, n)].outcome.value}"
            for n in CLASSES
            if a.verdicts[(gi, n)].outcome is not Outcome.NO_EVIDENCE
            or a.verdicts[(gi, n)].detail != "not run"
        ]
        lines.append(f"{list(ranks)} {' '.join(parts)}".rstrip())
    return tuple(lines)

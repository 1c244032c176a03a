"""What one SCOUT check found: :class:`ScoutResult` (also the structured log event)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

#: Name of the structured log event written once per check.
CHECK_EVENT = "scout.check"


class ScoutStatus(str, enum.Enum):
    """The job-wide outcome of one check."""

    HEALTHY = "healthy"
    """Every comparison group agreed bit for bit; no confirmed straggler."""
    STRAGGLER = "straggler"
    """No SDC, but a rank's replay was confirmed slow (the capture is not blocked)."""
    SDC = "sdc"
    """A strict majority of a group named the faulty rank(s)."""
    INCONCLUSIVE = "inconclusive"
    """A mismatch no majority can attribute (e.g. two peers); treated as SDC."""

    @property
    def corrupt(self) -> bool:
        """Whether certification treats this result as SDC (skip, reject, verified recovery)."""
        return self in (ScoutStatus.SDC, ScoutStatus.INCONCLUSIVE)


@dataclass(frozen=True)
class Straggler:
    """A confirmed straggler: its replay time against the median of its peers."""

    rank: int
    slowdown: float
    """Replay time divided by the peers' median (the smaller of the two rounds)."""
    replay_s: float
    median_s: float


@dataclass(frozen=True)
class ScoutResult:
    """One check, identical on every rank (decided from the same all-gathered reports)."""

    step: int
    status: ScoutStatus
    faulty_ranks: tuple[int, ...] = ()
    stragglers: tuple[Straggler, ...] = ()
    recipe: str = ""
    """The recipes replayed on this rank's group, e.g. ``dense[3]:blocks.1 optimizer[3]``."""
    timings: dict[str, float] = field(default_factory=dict)
    """This rank's seconds: ``replay`` (sum over classes), ``exchange``, ``total``."""
    bytes_exchanged: int = 0
    """Bytes of SCOUT's collectives for this check on this rank: the spec, the group's
    reports (144 B per member) and the job-wide flags (120 B); not a factor of the world."""
    capture_allowed: bool = True
    """Whether a capture at this step may proceed (accepted, and no SDC seen before)."""
    reason: str = ""
    """Why: the groups that disagreed, inconclusive comparisons, missing evidence."""
    rerun: bool = False
    """Whether a confirmation re-run happened (a mismatch or a straggler suspect)."""
    complete_cycle: bool = False
    """Whether this check completed a dynamic-catalog cycle job-wide (a sweep: all recipes)."""
    groups: tuple[str, ...] = ()
    """This rank's comparison group's verdict per class, e.g. ``[0, 1, 2] dense=clean opt=clean``
    (reports travel inside the group; what other groups found is in ``status`` and
    ``reason``, from the job-wide flags)."""

    @property
    def accepted(self) -> bool:
        """No SDC or inconclusive comparison anywhere in the job."""
        return not self.status.corrupt

    def to_event(self) -> dict[str, Any]:
        """JSON-ready fields of the ``scout.check`` event."""
        doc = asdict(self)
        doc["status"] = self.status.value
        doc["faulty_ranks"] = list(self.faulty_ranks)
        doc["stragglers"] = [asdict(s) for s in self.stragglers]
        doc["groups"] = list(self.groups)
        return doc

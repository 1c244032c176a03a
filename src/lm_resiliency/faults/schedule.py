"""Fault schedules: which fault hits which rank at which step.

Text form (command line, environment): comma-separated ``KIND@RANK:STEP``,
with a trailing ``*`` for a persistent fault (every attempt of that step, so
retries fail too); without it the fault fires once, on the first attempt::

    nan_grad@1:3, optimizer_exception@0:5*, sigkill@1:7

Two kinds script a membership instead of a fault (live membership, docs/live-membership.md §8):
``leave@R:S`` (replica ``R`` leaves cleanly before step ``S``) and ``join@R:S`` (``R`` is admitted
so that ``S`` is the first step it computes). For them the number before the colon is a replica
id, they fire once (no ``*``), and a join needs an earlier departure of the same replica::

    leave@1:23, join@1:30
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from lm_resiliency.errors import ConfigError


class FaultKind(enum.Enum):
    """What an injected fault does, and where (see :class:`FaultInjector`)."""

    NAN_GRAD = "nan_grad"
    """The first parameter's gradient becomes NaN on this rank (finite loss)."""
    DATA_EXCEPTION = "data_exception"
    """An exception before the model is called (e.g. while loading the batch)."""
    FORWARD_EXCEPTION = "forward_exception"
    """An exception inside the model's forward pass."""
    OOM = "oom"
    """``torch.OutOfMemoryError`` inside the model's forward pass."""
    BACKWARD_EXCEPTION = "backward_exception"
    """An exception inside the backward pass, after later layers' gradients exist."""
    OPTIMIZER_EXCEPTION = "optimizer_exception"
    """An exception after ``optimizer.step()`` updated the parameters, with half of them
    overwritten by NaN (a partial, corrupt update)."""
    FORCED_ABORT = "forced_abort"
    """This rank votes to abort without any error."""
    SIGKILL = "sigkill"
    """The process kills itself with SIGKILL in the middle of the backward pass."""
    SIGSTOP = "sigstop"
    """The process stops itself with SIGSTOP (a hang) in the middle of the backward pass."""
    LEAVE = "leave"
    """Replica ``rank`` leaves the membership cleanly before step ``step`` (live membership)."""
    JOIN = "join"
    """Replica ``rank`` is admitted with ``step`` as its first step (live membership)."""

    @property
    def scripts_membership(self) -> bool:
        """Whether this kind scripts a membership change (its number is a replica id)."""
        return self in _MEMBERSHIP


_MEMBERSHIP = frozenset({FaultKind.LEAVE, FaultKind.JOIN})
# Faults after which a replica is gone and may be scripted to join again.
_DEPARTURES = frozenset({FaultKind.LEAVE, FaultKind.SIGKILL, FaultKind.SIGSTOP})


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; ``step`` is 1-based, ``persistent`` hits every attempt.

    A one-shot fault (``persistent=False``) hits attempt 0 only, and the injector
    fires it at most once.
    """

    kind: FaultKind
    rank: int
    step: int
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 1:
            raise ConfigError(
                f"fault {self.kind.value}: rank={self.rank} must be >= 0 and step={self.step} >= 1"
            )
        if self.persistent and self.kind.scripts_membership:
            raise ConfigError(
                f"{self.kind.value}@{self.rank}:{self.step}* cannot be persistent: a replica "
                f"leaves or joins once; drop the '*'"
            )

    def hits(self, rank: int, step: int, attempt: int) -> bool:
        """Whether this fault fires for ``rank`` at ``step`` on attempt ``attempt`` (0-based)."""
        return rank == self.rank and step == self.step and (self.persistent or attempt == 0)

    def spec(self) -> str:
        """The text form, e.g. ``"nan_grad@1:3"``."""
        return f"{self.kind.value}@{self.rank}:{self.step}{'*' if self.persistent else ''}"


_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@(?P<rank>\d+):(?P<step>\d+)(?P<persistent>\*?)$")


@dataclass(frozen=True)
class FaultSchedule:
    """An ordered set of :class:`Fault`; empty means no fault."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        _check_membership_script(self.faults)

    @classmethod
    def parse(cls, text: str | None) -> FaultSchedule:
        """Parse the text form; raises ``ConfigError`` naming the bad item and the syntax."""
        if text is None or not text.strip():
            return cls()
        faults = []
        kinds = ", ".join(k.value for k in FaultKind)
        for raw in text.split(","):
            item = raw.strip()
            m = _ITEM.match(item)
            if m is None:
                raise ConfigError(
                    f"bad fault {item!r}: expected KIND@RANK:STEP with an optional trailing '*' "
                    f"(persistent), e.g. 'nan_grad@1:3'; kinds: {kinds}"
                )
            try:
                kind = FaultKind(m["kind"])
            except ValueError:
                raise ConfigError(
                    f"unknown fault kind {m['kind']!r} in {item!r}; kinds: {kinds}"
                ) from None
            faults.append(Fault(kind, int(m["rank"]), int(m["step"]), bool(m["persistent"])))
        return cls(tuple(faults))

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def spec(self) -> str:
        """The text form (round-trips through :meth:`parse`)."""
        return ",".join(f.spec() for f in self.faults)

    def for_rank(self, rank: int) -> FaultSchedule:
        """Only the faults of ``rank``."""
        return FaultSchedule(tuple(f for f in self.faults if f.rank == rank))

    def hitting(
        self, kinds: Iterable[FaultKind], rank: int, step: int, attempt: int
    ) -> list[Fault]:
        """The faults of ``kinds`` that fire for ``(rank, step, attempt)``."""
        wanted = set(kinds)
        return [f for f in self.faults if f.kind in wanted and f.hits(rank, step, attempt)]

    def members_at(self, step: int, replicas: int) -> tuple[int, ...]:
        """The replica ids computing ``step`` under the scripted ``leave``/``join`` items.

        Every replica ``0..replicas-1`` is a member at step 1; ``leave@R:S`` removes ``R`` from
        step ``S`` on and ``join@R:S`` adds it back from ``S`` on. Other faults do not count (a
        kill's effect is what the run records). Raises ``ConfigError`` for a scripted replica
        id outside ``0..replicas-1``.
        """
        members = set(range(replicas))
        for f in sorted(self.faults, key=lambda f: f.step):
            if not f.kind.scripts_membership:
                continue
            if f.rank >= replicas:
                raise ConfigError(
                    f"{f.spec()} names replica {f.rank} but the job has {replicas} replica "
                    f"groups (0..{replicas - 1})"
                )
            if f.step <= step:
                (members.discard if f.kind is FaultKind.LEAVE else members.add)(f.rank)
        return tuple(sorted(members))


def _check_membership_script(faults: Iterable[Fault]) -> None:
    """A replica leaves only while it is a member and joins only after it left (or died)."""
    by_replica: dict[int, list[Fault]] = {}
    for f in faults:
        if f.kind in _DEPARTURES or f.kind is FaultKind.JOIN:
            by_replica.setdefault(f.rank, []).append(f)
    for replica, items in by_replica.items():
        # At one step a departure comes before a join (the join must be at a later step).
        order = sorted(items, key=lambda f: (f.step, f.kind is FaultKind.JOIN))
        gone: Fault | None = None
        for f in order:
            if f.kind is FaultKind.JOIN:
                if gone is None:
                    raise ConfigError(
                        f"{f.spec()}: replica {replica} is a member at step {f.step}, so it "
                        f"cannot join; script its departure first, e.g. 'leave@{replica}:"
                        f"{max(1, f.step - 1)},{f.spec()}'"
                    )
                if f.step <= gone.step:
                    raise ConfigError(
                        f"{f.spec()} must be at a step after {gone.spec()} (a replica that "
                        f"leaves before step {gone.step} can join at step {gone.step + 1} "
                        "at the earliest)"
                    )
                gone = None
            elif f.kind is FaultKind.LEAVE and gone is not None:
                raise ConfigError(
                    f"{f.spec()}: replica {replica} already left at {gone.spec()}; script "
                    f"'join@{replica}:S' between them"
                )
            elif gone is None:
                gone = f

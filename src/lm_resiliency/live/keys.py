"""Key names and record codecs of the live-membership protocol (docs/live-membership.md §2.3).

Every key lives under ``lmr/live/<run>/`` on the coordinator's ``TCPStore``. Records are strict
JSON objects (:mod:`lm_resiliency._strict_json`); a malformed record raises ``ValueError`` naming
the key, never a half-read value.

========================  ================  ===============================================
key                       writer            value
========================  ================  ===============================================
``coord``                 coordinator       :class:`CoordRecord`, once at start
``coord/beat``            coordinator       ``"<n> <epoch>"``: a counter set every
                                            ``heartbeat_s/2`` with the published epoch
                                            (:func:`parse_beat`), and at every publication
``epoch``                 coordinator       the current epoch number (written after
                                            ``epoch/<E>``)
``epoch/<E>``             coordinator       :class:`EpochRecord`
``hb/<r>/<g>``            worker            :class:`Heartbeat`
``fail/<E>``              first of anyone   :class:`Failure` (``compare_set`` from absent)
``ack/<E>/<r>/<g>``       worker            :class:`Ack`
``join/<r>/<g>``          joining worker    :class:`Join`
``owner/<r>/<g>``         coordinator,      who may register as rank g of replica r while r
                          claimant          is not a member: ``open:<k>`` (vacant, the
                                            coordinator's k-th opening) or the incarnation
                                            that claimed it (``compare_set`` from the open
                                            value, so one claimant wins)
``spares``                warm spare        a counter: ``add`` gives each spare its id
``spare/<s>/take``        coordinator       :class:`Takeover`: spare s becomes a replica
``pg/<E>/g<g>/``          (prefix)          the epoch's cross-replica Gloo rendezvous
``heal/<E>/<r>/g<g>/``    (prefix)          the donor-to-joiner channel
========================  ================  ===============================================
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lm_resiliency import _strict_json

__all__ = [
    "Ack",
    "CoordRecord",
    "EpochRecord",
    "Failure",
    "OPEN",
    "Heartbeat",
    "Join",
    "Keys",
    "Takeover",
    "beat_value",
    "decode",
    "encode",
    "encode_text",
    "parse_beat",
]


@dataclass(frozen=True)
class Keys:
    """The key names of one run (``Keys("run-1").epoch_record(3)`` and so on)."""

    run: str

    def __post_init__(self) -> None:
        if not self.run or "/" in self.run or not self.run.isprintable():
            raise ValueError(
                f"live run id {self.run!r} must be a non-empty printable name without '/'; "
                "set LMR_LIVE_RUN (the launcher sets it) to e.g. 'run-1'"
            )

    @property
    def root(self) -> str:
        return f"lmr/live/{self.run}/"

    @property
    def coord(self) -> str:
        return self.root + "coord"

    @property
    def beat(self) -> str:
        return self.root + "coord/beat"

    @property
    def epoch(self) -> str:
        return self.root + "epoch"

    def epoch_record(self, epoch: int) -> str:
        return f"{self.root}epoch/{epoch}"

    def heartbeat(self, replica: int, group_rank: int) -> str:
        return f"{self.root}hb/{replica}/{group_rank}"

    def failure(self, epoch: int) -> str:
        return f"{self.root}fail/{epoch}"

    def ack(self, epoch: int, replica: int, group_rank: int) -> str:
        return f"{self.root}ack/{epoch}/{replica}/{group_rank}"

    def done(self, epoch: int, replica: int, group_rank: int) -> str:
        """A member finished training in ``epoch``; its value is the last committed step."""
        return f"{self.root}done/{epoch}/{replica}/{group_rank}"

    def join(self, replica: int, group_rank: int) -> str:
        return f"{self.root}join/{replica}/{group_rank}"

    def owner(self, replica: int, group_rank: int) -> str:
        """Who may register as ``r<replica>g<group_rank>`` while it is not a member (§6.3)."""
        return f"{self.root}owner/{replica}/{group_rank}"

    @property
    def spares(self) -> str:
        return self.root + "spares"

    def spare_take(self, spare: int) -> str:
        """Where the coordinator hands warm spare ``spare`` a replica (a :class:`Takeover`)."""
        return f"{self.root}spare/{spare}/take"

    def group_prefix(self, epoch: int, group_rank: int) -> str:
        """Prefix of epoch ``epoch``'s cross-replica group of group rank ``group_rank``."""
        return f"{self.root}pg/{epoch}/g{group_rank}/"

    def heal_prefix(self, epoch: int, replica: int, group_rank: int) -> str:
        return f"{self.root}heal/{epoch}/{replica}/g{group_rank}/"


@dataclass(frozen=True)
class CoordRecord:
    generation: int
    pid: int
    live_port: int
    """The liveness-socket port (EOF on it tells the coordinator a worker died)."""


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    members: tuple[int, ...]
    """Replica ids, sorted. Empty: below ``min_replicas`` (every worker falls back) or the
    run finished."""
    reason: str
    """``"start"``, ``"lost"``, ``"leave"``, ``"admit"`` (a heal is scheduled, members
    unchanged), ``"admitted"`` (the healed joiner is a member), ``"admission cancelled"``,
    ``"below min_replicas"``, ``"finished"`` (every member published ``done/``; no
    members, ``resume_step`` is the last committed step)."""
    cause: str = ""
    resume_step: int = 0
    """The newest step every member holds committed; the new membership computes
    ``resume_step + 1`` first (its ``effective_step``)."""
    t_detect: float = 0.0
    t_publish: float = 0.0
    heal: dict[str, int] | None = None
    """``{"joiner": r, "donor": d, "step": h}`` for an admission."""
    incarnations: dict[str, str] = field(default_factory=dict)
    """``"<replica>/<group rank>"`` of every member rank to the incarnation admitted
    (fencing: a rank whose incarnation is not here is not a member). An ``"admit"`` record
    also names the joiner's ranks (they are not members yet: :meth:`admits` is False)."""

    @property
    def effective_step(self) -> int:
        return self.resume_step + 1

    def admits(self, replica: int, group_rank: int, inc: str) -> bool:
        """Whether incarnation ``inc`` of rank ``group_rank`` of ``replica`` is a member."""
        return replica in self.members and self.incarnations.get(f"{replica}/{group_rank}") == inc

    def heals(self, replica: int, group_rank: int, inc: str) -> bool:
        """Whether this is an ``"admit"`` record scheduling the heal of incarnation ``inc``."""
        return (
            self.reason == "admit"
            and self.heal is not None
            and self.heal.get("joiner") == replica
            and self.incarnations.get(f"{replica}/{group_rank}") == inc
        )


@dataclass(frozen=True)
class Heartbeat:
    inc: str
    epoch: int
    committed: int
    t: float


@dataclass(frozen=True)
class Failure:
    by: str
    """``"r<replica>g<group rank>"`` or ``"coordinator"``."""
    reason: str
    t: float
    inc: str = ""
    """The writer's incarnation (empty for the coordinator); a non-member's is ignored."""


@dataclass(frozen=True)
class Ack:
    inc: str
    committed: int
    """The newest step whose commit confirmation completed on this rank."""
    applied: int | None = None
    """A step whose update ran but whose confirmation did not complete."""
    shadow_of: int | None = None
    """The step whose pre-state the shadow holds."""
    in_flight: int | None = None
    pid: int = 0
    digest: str = ""
    """A joiner's ack of a heal: the digest of the state it loaded (``live.heal.state_digest``)."""
    error: str = ""
    """A joiner's ack of a heal that failed: why (the coordinator cancels the admission)."""


@dataclass(frozen=True)
class Join:
    inc: str
    host: str
    pid: int
    slot_step: int = 0
    at_step: int = 0
    """The heal step a scripted ``join@R:S`` asks for (``S - 1``); 0: the coordinator's."""


@dataclass(frozen=True)
class Takeover:
    """A warm spare's assignment: it registers as rank 0 of ``replica`` with incarnation ``inc``
    (the value the coordinator swapped into ``owner/<replica>/0``)."""

    replica: int
    inc: str
    t: float
    """Wall-clock time of the assignment."""


def beat_value(n: int, epoch: int) -> str:
    """The coordinator's ``coord/beat`` value: its beat counter and the published epoch."""
    return f"{n} {epoch}"


def parse_beat(raw: bytes) -> int:
    """The published epoch in a ``coord/beat`` value (-1 before epoch 0)."""
    _, _, epoch = raw.partition(b" ")
    try:
        return int(epoch) if epoch else -1
    except ValueError:
        raise ValueError(f"coord/beat value {raw[:40]!r} is not '<n> <epoch>'") from None


OPEN = "open:"
"""The prefix of an ``owner/<r>/<g>`` value that leaves the rank vacant (``open:<k>``)."""

_Record = TypeVar("_Record", CoordRecord, EpochRecord, Heartbeat, Failure, Ack, Join, Takeover)
_Any = CoordRecord | EpochRecord | Heartbeat | Failure | Ack | Join | Takeover


def encode(record: _Any) -> bytes:
    """The record as compact strict JSON bytes (what ``store.set`` takes)."""
    return json.dumps(dataclasses.asdict(record), separators=(",", ":"), allow_nan=False).encode()


def encode_text(record: _Any) -> str:
    """:func:`encode` as ``str`` (ASCII JSON), the type ``Store.set``/``compare_set`` declare."""
    return encode(record).decode("ascii")


def decode(kind: type[_Record], raw: bytes, *, key: str) -> _Record:
    """Parse ``raw`` (read from ``key``) as a ``kind``; ``ValueError`` names the key and field."""
    try:
        doc: Any = _strict_json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"live record {key!r} is not strict JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"live record {key!r} is not a JSON object")
    names = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(doc) - set(names))
    if unknown:
        raise ValueError(f"live record {key!r} has unknown fields {unknown} for {kind.__name__}")
    if "members" in doc:
        if not isinstance(doc["members"], list) or not all(
            isinstance(m, int) and not isinstance(m, bool) for m in doc["members"]
        ):
            raise ValueError(f"live record {key!r}: members must be a list of replica ids")
        doc["members"] = tuple(doc["members"])
    try:
        record = kind(**doc)
    except TypeError as exc:
        raise ValueError(f"live record {key!r} is not a {kind.__name__}: {exc}") from None
    hints = _hints(kind)
    for f in dataclasses.fields(kind):
        value = getattr(record, f.name)
        if not _is(value, hints[f.name]):
            raise ValueError(
                f"live record {key!r}: {kind.__name__}.{f.name}={value!r} is not {hints[f.name]}"
            )
    return record


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(kind: type) -> dict[str, Any]:
    if kind not in _HINTS:
        _HINTS[kind] = typing.get_type_hints(kind)
    return _HINTS[kind]


def _is(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value fits a record field's annotation (the few kinds used)."""
    if isinstance(hint, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:  # tuple[int, ...]
        return isinstance(value, tuple) and all(_is(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _is(k, args[0]) and _is(v, args[1]) for k, v in value.items()
        )
    raise AssertionError(f"record annotation {hint!r} is not supported")

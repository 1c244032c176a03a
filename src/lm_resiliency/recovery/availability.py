"""Which steps of each rank's state can be obtained, and from where.

Every rank reports five step sets: its own state in memory and on its
node-local disk, the state it can *serve* to its peer (the rank it receives
replicas from: the replica it holds, or in HSDP mode its own identical shard)
from memory and from disk, and the steps it recorded as verified. From all
reports every rank computes the same table: for rank ``r`` and step ``s``,
every source that can deliver it, cheapest first (own memory < own disk <
peer memory < peer disk). The recovery step is the newest step every rank can
obtain from at least one source; when a source fails validation, the next one
for the same step is tried before anybody walks back.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lm_resiliency.control import ControlPlane


class Source(enum.IntEnum):
    """Where a rank's state comes from, cheapest first."""

    OWN_MEMORY = 0
    OWN_DISK = 1
    PEER_MEMORY = 2
    PEER_DISK = 3
    FALLBACK = 4

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")

    @property
    def remote(self) -> bool:
        return self in (Source.PEER_MEMORY, Source.PEER_DISK)


@dataclass(frozen=True)
class Report:
    """One rank's availability (see the module docstring)."""

    own_memory: frozenset[int] = field(default_factory=frozenset)
    own_disk: frozenset[int] = field(default_factory=frozenset)
    serve_memory: frozenset[int] = field(default_factory=frozenset)
    serve_disk: frozenset[int] = field(default_factory=frozenset)
    verified: frozenset[int] = field(default_factory=frozenset)

    def to_json(self) -> list[list[int]]:
        return [sorted(s) for s in self._sets()]

    def _sets(self) -> tuple[frozenset[int], ...]:
        return (self.own_memory, self.own_disk, self.serve_memory, self.serve_disk, self.verified)

    @classmethod
    def from_json(cls, doc: object) -> Report:
        if not (
            isinstance(doc, list)
            and len(doc) == 5
            and all(isinstance(x, list) and all(_step(v) for v in x) for x in doc)
        ):
            raise ValueError(f"malformed availability report {doc!r:.200}")
        return cls(*(frozenset(x) for x in doc))

    def describe(self) -> str:
        names = ("own memory", "own disk", "serves from memory", "serves from disk")
        return ", ".join(
            f"{n} {sorted(s) or '-'}" for n, s in zip(names, self._sets(), strict=False)
        )


def _step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def gather_reports(report: Report, *, control: ControlPlane) -> list[Report]:
    """Collective: every rank's :class:`Report`, in group-rank order (bounded, named)."""
    blob = json.dumps(report.to_json(), separators=(",", ":")).encode()
    gathered = control.all_gather_bytes(blob, name="find_latest: gather availability")
    return [Report.from_json(json.loads(b)) for b in gathered]


Options = list[dict[int, list[Source]]]
"""Per rank: step -> every source that can deliver it, cheapest first."""


def source_options(reports: Sequence[Report], holder_of: Callable[[int], int | None]) -> Options:
    """Per rank, the sources of every step. ``holder_of(r)``: the rank that serves r's state."""
    table: Options = []
    for rank, rep in enumerate(reports):
        holder = holder_of(rank)
        served = reports[holder] if holder is not None else Report()
        options: dict[int, list[Source]] = {}
        for source, steps in (
            (Source.OWN_MEMORY, rep.own_memory),
            (Source.OWN_DISK, rep.own_disk),
            (Source.PEER_MEMORY, served.serve_memory),
            (Source.PEER_DISK, served.serve_disk),
        ):
            for s in steps:
                options.setdefault(s, []).append(source)
        table.append(options)
    return table


def common_steps(table: Options, reports: Sequence[Report], *, verified_only: bool) -> set[int]:
    """Steps every rank can obtain (and, ``verified_only``, every rank recorded as verified)."""
    common = set(table[0]).intersection(*table[1:]) if table else set()
    if verified_only:
        common = {s for s in common if all(s in r.verified for r in reports)}
    return common


def missing_lines(step: int, table: Options, reports: Sequence[Report]) -> list[str]:
    """For every rank that cannot obtain ``step``: what it has instead."""
    return [
        f"rank {r}: no copy of step {step} ({reports[r].describe()})"
        for r, options in enumerate(table)
        if step not in options
    ]

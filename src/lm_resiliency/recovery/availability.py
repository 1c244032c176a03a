"""Which steps of each rank's state can be obtained, and from where.

Every rank reports four step sets: its own state in memory and on its node-local
disk, and the replica it holds *for its peer* (the rank that sends to it) in
memory and on disk. From all reports every rank computes the same table: for
rank ``r`` and step ``s``, the cheapest source (own memory < own disk < peer
memory < peer disk). The recovery step is the newest step every rank can obtain.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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


@dataclass(frozen=True)
class Report:
    """One rank's availability: its own steps, those it holds for its peer, its verified steps."""

    own_memory: frozenset[int] = field(default_factory=frozenset)
    own_disk: frozenset[int] = field(default_factory=frozenset)
    held_memory: frozenset[int] = field(default_factory=frozenset)
    held_disk: frozenset[int] = field(default_factory=frozenset)
    verified: frozenset[int] = field(default_factory=frozenset)

    def sets(self) -> list[frozenset[int]]:
        return [self.own_memory, self.own_disk, self.held_memory, self.held_disk, self.verified]


def gather_reports(report: Report, *, group: dist.ProcessGroup | None) -> list[Report]:
    """Collective: every rank's :class:`Report`, in group-rank order (two small collectives)."""
    sets = report.sets()
    if group is None:
        return [report]
    world = dist.get_world_size(group)
    width_t = torch.tensor([max(len(s) for s in sets)], dtype=torch.int64)
    dist.all_reduce(width_t, op=dist.ReduceOp.MAX, group=group)
    width = max(1, int(width_t.item()))
    mine = torch.full((len(sets), width), -1, dtype=torch.int64)
    for row, s in enumerate(sets):
        if s:
            mine[row, : len(s)] = torch.tensor(sorted(s), dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    reports = []
    for t in out:
        rows = [frozenset(int(v) for v in r.tolist() if v >= 0) for r in t]
        reports.append(Report(*rows))
    return reports


def source_table(
    reports: Sequence[Report], holder_of: Callable[[int], int | None]
) -> list[dict[int, Source]]:
    """Per rank: step -> cheapest source. ``holder_of(r)`` is the rank holding r's replica."""
    table: list[dict[int, Source]] = []
    for rank, rep in enumerate(reports):
        options: dict[int, Source] = {}
        holder = holder_of(rank)
        held = reports[holder] if holder is not None else Report()
        for source, steps in (
            (Source.PEER_DISK, held.held_disk),
            (Source.PEER_MEMORY, held.held_memory),
            (Source.OWN_DISK, rep.own_disk),
            (Source.OWN_MEMORY, rep.own_memory),
        ):
            for s in steps:
                options[s] = source  # later (cheaper) sources overwrite dearer ones
        table.append(options)
    return table

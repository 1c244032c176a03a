"""Comparison groups: the ranks that hold identical replicas of the same parameters.

SCOUT compares replay results only inside a group (topology-specific) and decides
job-wide (every rank sees every group's verdict). Build the groups from the
parallel layout:

* :meth:`ComparisonGroups.ddp` - plain data parallelism: every rank of the job
  holds the whole model; compared in groups of :data:`DDP_GROUP_SIZE` consecutive
  ranks, so the report exchange does not grow with the job;
* :meth:`ComparisonGroups.hsdp` / :meth:`from_mesh` - HSDP: ranks with the same
  shard index along the replicate dimension hold identical shards;
* :meth:`ComparisonGroups.from_ranks` - a framework adapter's data-parallel
  groups (e.g. Megatron's DP groups of one tensor/pipeline coordinate).

Every rank of the job must be in exactly one group of at least two ranks: a rank
without a replica cannot be checked, and SCOUT never certifies without evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import ConfigError

DDP_GROUP_SIZE = 8
"""Default comparison group size under plain DDP (every rank holds the same replica).

Bounds the report all-gather at 144 B x 8 per rank and check at any world size; 8
peers still name a faulty rank by strict majority with up to 3 faulty peers in one
group, and give the straggler rule 7 peer timings; consecutive ranks are usually one
host (8 accelerators), so the group's exchange stays on it. docs/scout.md, "Comparison
groups"."""


def bounded_replica_groups(ranks: Sequence[int], size: int | None) -> tuple[tuple[int, ...], ...]:
    """``ranks`` (replicas of each other) in groups of ``size`` consecutive ranks.

    ``None`` or ``size >= len(ranks)``: one group. A remainder smaller than 3 joins the
    last group (a strict majority needs 3). Raises ``ConfigError`` for ``size < 3``.
    """
    ranks = tuple(sorted(ranks))
    if size is None or size >= len(ranks):
        return (ranks,)
    if isinstance(size, bool) or not isinstance(size, int) or size < 3:
        raise ConfigError(
            f"size={size!r} must be an int >= 3 (a strict majority names a faulty rank), or "
            "None for one group of every replica"
        )
    starts = list(range(0, len(ranks), size))
    if len(ranks) - starts[-1] < 3:
        starts.pop()
    ends = [*starts[1:], len(ranks)]
    return tuple(ranks[a:b] for a, b in zip(starts, ends, strict=True))


@dataclass(frozen=True)
class ComparisonGroups:
    """A partition of ranks ``0 .. world_size-1`` into replica groups (each sorted)."""

    groups: tuple[tuple[int, ...], ...]
    world_size: int

    def __post_init__(self) -> None:
        seen: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            if len(g) < 2:
                raise ConfigError(
                    f"comparison group {i} {list(g)} has {len(g)} rank; SCOUT needs at least two "
                    "replicas per group to compare (a single replica gives no evidence). Use "
                    "data-parallel degree >= 2 or disable SCOUT"
                )
            for r in g:
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
                    raise ConfigError(
                        f"comparison group {i} names rank {r!r}, outside 0..{self.world_size - 1}"
                    )
                if r in seen:
                    raise ConfigError(
                        f"rank {r} is in comparison groups {seen[r]} and {i}; every rank must be "
                        "in exactly one group"
                    )
                seen[r] = i
        missing = sorted(set(range(self.world_size)) - set(seen))
        if missing:
            raise ConfigError(
                f"ranks {missing[:8]} are in no comparison group; list every rank of the "
                f"world (size {self.world_size}) in exactly one group"
            )

    # -- constructors ------------------------------------------------------------

    @classmethod
    def ddp(cls, world_size: int, *, size: int | None = DDP_GROUP_SIZE) -> ComparisonGroups:
        """Plain DDP: all ``world_size`` ranks are replicas of each other.

        Compared in groups of ``size`` consecutive ranks (default
        :data:`DDP_GROUP_SIZE`; every rank holds the same replica, so any partition is
        sound), so the report all-gather stays bounded at any world size; ``None``:
        one group of the world. A remainder smaller than 3 joins the last group.
        """
        return cls(bounded_replica_groups(range(world_size), size), world_size)

    @classmethod
    def hsdp(cls, world_size: int, *, shard_size: int) -> ComparisonGroups:
        """HSDP on a row-major ``(replicate, shard)`` mesh: rank ``= r * shard_size + s``.

        Group ``s`` holds the ranks of shard index ``s`` in every replica.
        """
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ConfigError(f"shard_size={shard_size!r} must be a positive int")
        if world_size % shard_size:
            raise ConfigError(
                f"shard_size={shard_size} does not divide world_size={world_size}; use the "
                "size of the mesh's shard dimension"
            )
        groups = tuple(tuple(range(s, world_size, shard_size)) for s in range(shard_size))
        return cls(groups, world_size)

    @classmethod
    def from_mesh(cls, mesh: Any, *, replicate_dim: int | str = 0) -> ComparisonGroups:
        """From a ``torch.distributed.DeviceMesh``: groups along ``replicate_dim``.

        Every slice of the mesh along the replicate dimension (all other
        coordinates fixed) is one group.
        """
        ranks = mesh.mesh
        names = getattr(mesh, "mesh_dim_names", None) or ()
        dim = names.index(replicate_dim) if isinstance(replicate_dim, str) else replicate_dim
        if not 0 <= dim < ranks.dim():
            raise ConfigError(f"replicate_dim={replicate_dim!r} is not a dimension of the mesh")
        moved = torch.movedim(ranks, dim, -1).reshape(-1, ranks.shape[dim])
        groups = [tuple(sorted(int(r) for r in row)) for row in moved.tolist()]
        return cls.from_ranks(groups, world_size=int(ranks.numel()))

    @classmethod
    def from_ranks(cls, groups: Sequence[Sequence[int]], *, world_size: int) -> ComparisonGroups:
        """A framework adapter's replica groups (any order; each is sorted here)."""
        normalized = tuple(sorted(tuple(sorted(g)) for g in groups))
        return cls(normalized, world_size)

    # -- queries -------------------------------------------------------------------

    def index_of(self, rank: int) -> int:
        """The index of the group holding ``rank``."""
        for i, g in enumerate(self.groups):
            if rank in g:
                return i
        raise KeyError(rank)

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group."""
        return self.groups[self.index_of(rank)]

    def source_of(self, rank: int) -> int:
        """The group's source peer (its lowest rank): it chooses and broadcasts the replay."""
        return self.group_of(rank)[0]

    def describe(self) -> str:
        shown = ", ".join(str(list(g)) for g in self.groups[:4])
        more = f" ... ({len(self.groups)} groups)" if len(self.groups) > 4 else ""
        return f"{shown}{more}"

"""Collective agreement on the recovery step.

Each rank contributes the set of steps of *its own* state that it can obtain;
the chosen step is the newest one in every rank's set, so a step present on
only part of the job is never selected.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch
import torch.distributed as dist


class RecoveryMode(str, enum.Enum):
    """Which steps recovery may choose."""

    LATEST = "latest"
    """The newest step every rank can load."""

    RECOVERY_VERIFIED = "recovery_verified"
    """The newest step every rank can load that was certified (fail closed otherwise)."""


def gather_step_sets(steps: Iterable[int], *, group: dist.ProcessGroup | None) -> list[set[int]]:
    """Collective: every rank's step set, in group-rank order (two small all-reduce/gathers)."""
    mine = sorted(set(steps))
    if group is None:
        return [set(mine)]
    world = dist.get_world_size(group)
    count = torch.tensor([len(mine)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    width = int(count.item())
    if width == 0:
        return [set() for _ in range(world)]
    padded = torch.full((width,), -1, dtype=torch.int64)
    if mine:
        padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [{int(v) for v in t.tolist() if v >= 0} for t in out]


def newest_common(step_sets: list[set[int]]) -> int | None:
    """The newest step contained in every set, or ``None``."""
    if not step_sets:
        return None
    common = set.intersection(*step_sets)
    return max(common) if common else None


def agree_on_step(steps: Iterable[int], *, group: dist.ProcessGroup | None) -> int | None:
    """Collective: the newest step every rank of ``group`` listed, or ``None``."""
    return newest_common(gather_step_sets(steps, group=group))

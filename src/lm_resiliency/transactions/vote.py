"""Explicit vote collectives: the commit confirmation and the hook-less vote.

Both are one all-reduce of ``world_size`` int32 values: this rank writes its
abort code into its own slot, the sum gives every rank every rank's code, and
each rank derives the same decision from the same numbers. The wait is bounded
by ``timeout_s``; a timeout or lost peer raises, it is never taken for a vote.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lm_resiliency.transactions.reasons import decode_codes


class CollectiveCounter:
    """Counts the collectives MTGS itself issues, each kind named for what it is.

    ``explicit_votes``: vote all-reduces of the hook-less ablation
    (``vote_in_hook=False``), one per attempt; ``commit_confirmations``: the
    two-phase commit's confirmation all-reduces, one per attempt that reached
    the commit; ``fallback_allreduces``: zero-gradient bucket all-reduces a
    failed rank issued so its peers do not block.
    """

    def __init__(self) -> None:
        self.explicit_votes = 0
        self.commit_confirmations = 0
        self.fallback_allreduces = 0


def exchange_codes(
    code: int,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout_s: float,
) -> dict[int, int]:
    """All-reduce this rank's abort ``code``; returns ``{rank: code}`` for every unhealthy rank.

    Collective: every rank of ``group`` must call it at the same point of the
    same step. Raises ``RuntimeError`` (from the process group) when a peer is
    lost or the wait exceeds ``timeout_s``.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    vector = torch.zeros(world, dtype=torch.int32, device=device)
    vector[rank] = code
    work = dist.all_reduce(vector, group=group, async_op=True)
    assert work is not None
    work.wait(timeout=timedelta(seconds=timeout_s))
    return decode_codes(vector)

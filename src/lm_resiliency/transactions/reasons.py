"""Why a rank voted to abort a step: one bit per reason, OR-ed into a small integer.

The codes travel inside the gradient all-reduce (one slot per rank, the other
ranks contribute zero), so every rank decodes the same per-rank reasons. Vote
codes stay below 2**8 so they are exact even in a bfloat16 gradient bucket
(8 significant bits: every integer up to 256); commit-phase codes travel in an
int32 tensor of their own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch


class AbortReason(enum.IntFlag):
    """One reason for a rank to vote "abort"; combine with ``|``."""

    # Vote phase (before optimizer.step): carried by the gradient buckets.
    NONFINITE_LOSS = 1 << 0
    NONFINITE_GRAD = 1 << 1
    FORWARD_EXCEPTION = 1 << 2
    BACKWARD_EXCEPTION = 1 << 3
    OUT_OF_MEMORY = 1 << 4
    HEALTH_CHECK = 1 << 5
    FORCED = 1 << 6
    LOW_MEMORY = 1 << 7
    """Memory headroom below ``MTGSConfig.min_memory_headroom`` (see ``memory_health``)."""
    # Commit phase (optimizer.step and the post-step checks): an int32 all-reduce.
    STEP_EXCEPTION = 1 << 8
    NONFINITE_PARAMS = 1 << 9
    LATE_FAILURE = 1 << 10
    # Vote phase, but decided from the reduced vote vector rather than carried in it: a
    # member's epoch mark differs from this rank's, or a non-member's slot is not empty
    # (live membership, docs/live-membership.md §4.1). Nothing was applied.
    STALE_EPOCH = 1 << 11


VOTE_REASONS_MAX = 1 << 8
"""Every vote-phase code a rank carries in a bucket is below this value (exact in bfloat16
buckets); ``STALE_EPOCH`` is read from the epoch marks, never carried."""


def reason_names(code: int) -> tuple[str, ...]:
    """Lower-case names of the bits set in ``code`` (``("nonfinite_grad",)``), in bit order."""
    names = []
    for member in AbortReason:
        if code & member.value:
            names.append(str(member.name).lower())
    unknown = code & ~sum(m.value for m in AbortReason)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return tuple(names)


def decode_codes(flags: torch.Tensor | Sequence[float]) -> dict[int, int]:
    """Per-rank codes from a reduced flag vector (slot r = rank r's code); healthy ranks omitted.

    Reads the tensor once (one host sync); values are rounded because they
    travelled in a floating-point gradient bucket.
    """
    values = flags.tolist() if isinstance(flags, torch.Tensor) else list(flags)
    return {rank: round(v) for rank, v in enumerate(values) if round(v) != 0}


def describe(codes: Mapping[int, int]) -> str:
    """``"rank 1: nonfinite_grad; rank 3: forward_exception+out_of_memory"`` (sorted by rank)."""
    if not codes:
        return "no rank reported a failure"
    return "; ".join(
        f"rank {rank}: {'+'.join(reason_names(code))}" for rank, code in sorted(codes.items())
    )

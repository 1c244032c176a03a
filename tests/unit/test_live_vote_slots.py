"""The live vote vector: 2R slots, the epoch mark, STALE_EPOCH for a wrong mark or a ghost."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm_resiliency.transactions import AbortReason
from lm_resiliency.transactions.reducer import epoch_mark, live_codes, live_vector


@dataclass
class _Slots:
    """The slot fields of a Reducer (what live_vector/live_codes read)."""

    epoch: int
    slot: int
    slots: int
    members: tuple[int, ...]


def _sum(*vectors: torch.Tensor) -> torch.Tensor:
    return torch.stack(vectors).sum(0)


def test_epoch_marks_are_exact_in_bfloat16_and_never_zero() -> None:
    marks = [epoch_mark(e) for e in range(300)]
    assert min(marks) == 1 and max(marks) == 128
    for m in set(marks):
        assert torch.tensor(float(m), dtype=torch.bfloat16).item() == m


def test_matching_marks_accept_the_codes() -> None:
    members = (0, 2, 3)  # replica 1 was lost
    views = [_Slots(5, r, 4, members) for r in members]
    code = torch.tensor(float(AbortReason.NONFINITE_LOSS))
    vecs = [
        live_vector(
            code if v.slot == 2 else torch.tensor(0.0), v, torch.bfloat16, torch.device("cpu")
        )
        for v in views
    ]
    reduced = _sum(*vecs)
    for v in views:
        assert live_codes(reduced, v) == {2: int(AbortReason.NONFINITE_LOSS)}


def test_a_stale_mark_or_a_non_member_slot_votes_stale_epoch() -> None:
    cpu, zero = torch.device("cpu"), torch.tensor(0.0)
    now = [_Slots(6, r, 4, (0, 1)) for r in (0, 1)]
    stale = _Slots(5, 1, 4, (0, 1))  # replica 1 still on epoch 5
    reduced = _sum(
        live_vector(zero, now[0], torch.float32, cpu), live_vector(zero, stale, torch.float32, cpu)
    )
    assert live_codes(reduced, now[0]) == {1: int(AbortReason.STALE_EPOCH)}
    assert live_codes(reduced, stale) == {0: int(AbortReason.STALE_EPOCH)}
    ghost = _Slots(6, 3, 4, (0, 1, 3))  # believes it is a member; the others do not
    reduced = _sum(*(live_vector(zero, v, torch.float32, cpu) for v in (*now, ghost)))
    assert live_codes(reduced, now[0]) == {3: int(AbortReason.STALE_EPOCH)}

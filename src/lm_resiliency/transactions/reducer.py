"""The seam between MTGS and whatever averages the gradients across data-parallel replicas.

MTGS's comm hook and its commit confirmation reduce through a :class:`Reducer`. The default,
:class:`GroupReducer`, is today's behaviour: the DDP model's own process group, weight
``1/world_size``, one vote slot per rank, epoch 0, and a lost peer ends the job. A *live*
reducer (``lm_resiliency.live.reducer.LiveReducer``) reduces over a cross-replica group that
is rebuilt when a replica is lost: its collectives fail with a :class:`MembershipLoss`, and
MTGS then reports what this rank holds (:class:`LossReport`), calls :meth:`Reducer.reform`
and redoes the step under the new membership (``docs/live-membership.md`` §4).

``transactions`` never imports ``live``: the live reducer converts :class:`LossReport` into
the coordinator's ``Ack`` record and the epoch record into :class:`Reformed`.

Vote slots (live mode, ``docs/live-membership.md`` §4.1): the vote vector has ``2*slots``
entries; replica ``r`` writes its abort code into slot ``r`` and its epoch mark
``(epoch mod 2**7) + 1`` into slot ``slots + r``. :func:`live_codes` reads the summed vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

from lm_resiliency.transactions.reasons import AbortReason

__all__ = [
    "GroupReducer",
    "LossReport",
    "MembershipLoss",
    "Reducer",
    "Reformed",
    "epoch_mark",
    "exchange_live",
    "live_codes",
    "live_vector",
]


class MembershipLoss(RuntimeError):
    """A collective failed because a replica was lost (base of ``live.view.EpochFailed``).

    In live mode MTGS takes it for a membership change, not for the end of the job.
    """


@dataclass(frozen=True)
class LossReport:
    """What this rank holds when its epoch failed (becomes the coordinator's ``Ack``)."""

    committed: int
    """The newest step whose commit confirmation completed on this rank."""
    applied: int | None = None
    """A step whose update ran here but whose confirmation did not complete."""
    shadow_of: int | None = None
    """The step whose pre-state the shadow holds (``None``: no shadow)."""
    in_flight: int | None = None
    """The step that was running when the epoch failed."""


@dataclass(frozen=True)
class Reformed:
    """The membership MTGS redoes the step under (from the coordinator's epoch record)."""

    epoch: int
    members: tuple[int, ...]
    resume_step: int
    """The newest step every member holds committed; ``resume_step + 1`` is computed next."""


class Reducer(Protocol):
    """Reduces gradient buckets and vote vectors across the data-parallel replicas.

    Called on the training thread only. ``allreduce`` is a SUM, in place; the caller
    pre-scales by ``weight``. A live reducer's collectives fail with a
    :class:`MembershipLoss` (raised by ``wait`` or set on the future) within one poll slice
    of a lost replica.
    """

    @property
    def live(self) -> bool:
        """Whether a lost replica is survived (``reform``) instead of ending the job."""
        ...

    @property
    def epoch(self) -> int: ...

    @property
    def slot(self) -> int:
        """This replica's vote slot (its replica id; the rank for the default reducer)."""
        ...

    @property
    def slots(self) -> int:
        """Vote slots: R, the replicas of a full world (the world size by default)."""
        ...

    @property
    def members(self) -> tuple[int, ...]:
        """Slots of the current members, sorted."""
        ...

    @property
    def weight(self) -> float:
        """This replica's share of the global batch (``n_i / B``; ``1/world`` by default)."""
        ...

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Start a SUM all-reduce of ``tensor`` in place; the future yields ``tensor``."""
        ...

    def wait(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """Wait (bounded) for ``future``; raises its error."""
        ...

    def reform(self, report: LossReport) -> Reformed:
        """After a :class:`MembershipLoss`: report, wait for the next epoch, adopt it."""
        ...


class GroupReducer:
    """Today's behaviour: a fixed process group that a lost peer makes unusable.

    The MTGS hook keeps its own fast path for this reducer (``buffer.div_(world)`` and one
    ``dist.all_reduce`` per bucket, exactly as before the seam); these methods serve other
    callers of the protocol.
    """

    live = False
    epoch = 0

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @property
    def slot(self) -> int:
        return self.rank

    @property
    def slots(self) -> int:
        return self.world_size

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    def weight(self) -> float:
        return 1.0 / self.world_size

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        assert work is not None
        fut = cast(torch.futures.Future[list[torch.Tensor]], work.get_future())
        return fut.then(lambda f: f.value()[0])

    def wait(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        return future.wait()

    def reform(self, report: LossReport) -> Reformed:
        raise MembershipLoss(
            "the default reducer has no live membership: a lost peer ends the job (enable "
            "live membership to survive it)"
        )


def epoch_mark(epoch: int) -> int:
    """The epoch's mark in the vote (1..128: exact in a bfloat16 bucket, 0 means absent)."""
    return epoch % (1 << 7) + 1


def live_vector(
    code: torch.Tensor, reducer: Reducer, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The ``2*slots`` vote vector of this replica: its code and its epoch mark."""
    vector = torch.zeros(2 * reducer.slots, dtype=dtype, device=device)
    vector[reducer.slot] = code.to(dtype)
    vector[reducer.slots + reducer.slot] = epoch_mark(reducer.epoch)
    return vector


def live_codes(reduced: torch.Tensor | list[float], reducer: Reducer) -> dict[int, int]:
    """Per-slot codes of a summed live vote vector; a wrong epoch mark votes ``STALE_EPOCH``.

    The vote counts only if every member's mark equals this rank's and every non-member's
    slots are 0 (``docs/live-membership.md`` §4.1); otherwise each offending slot is
    reported with ``STALE_EPOCH`` and the step aborts. Reads the tensor once.
    """
    raw = reduced.tolist() if isinstance(reduced, torch.Tensor) else reduced
    values = [round(v) for v in raw]
    slots = reducer.slots
    if len(values) != 2 * slots:
        raise ValueError(f"a live vote vector has {2 * slots} entries, got {len(values)}")
    mark = epoch_mark(reducer.epoch)
    members = set(reducer.members)
    codes: dict[int, int] = {}
    for r in range(slots):
        code, seen = values[r], values[slots + r]
        if r in members:
            if seen != mark:
                code |= AbortReason.STALE_EPOCH
        elif code or seen:
            code |= AbortReason.STALE_EPOCH
        if code:
            codes[r] = int(code)
    return codes


def exchange_live(code: int, reducer: Reducer, device: torch.device) -> dict[int, int]:
    """The commit confirmation in live mode: the same slots as the vote, int32, polled."""
    vector = live_vector(torch.tensor(code), reducer, torch.int32, device)
    return live_codes(reducer.wait(reducer.allreduce(vector)), reducer)

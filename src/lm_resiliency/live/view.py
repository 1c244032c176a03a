"""What the cross-replica group, the reducer and the transaction need from the membership.

:class:`lm_resiliency.live.membership.Membership` implements :class:`MembershipView`. The
seam exists so that ``group``/``reducer`` can be built and tested against the coordinator's
real store without the lease machinery, and so that the front door can hold one object.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from lm_resiliency.live.keys import Ack, EpochRecord, Keys
from lm_resiliency.transactions.reducer import MembershipLoss

__all__ = [
    "BelowMinReplicas",
    "CoordinatorLost",
    "EpochFailed",
    "Evicted",
    "MembershipView",
    "ReplicaTaken",
    "RunFinished",
]


class EpochFailed(MembershipLoss):
    """A collective of membership epoch ``epoch`` failed or was abandoned (a peer was lost).

    A :class:`~lm_resiliency.transactions.reducer.MembershipLoss`: MTGS in live mode takes it
    for a membership change.

    Raised on the caller's thread within one poll slice of the loss; the survivor then
    acknowledges the epoch and reforms (:meth:`MembershipView.reform`).
    """

    def __init__(self, epoch: int, cause: str) -> None:
        super().__init__(f"membership epoch {epoch} failed: {cause}")
        self.epoch = epoch
        self.cause = cause


class Evicted(RuntimeError):
    """This replica is not a member of the new epoch (it was hung, or it is fenced).

    The front door exits with code 76; torchrun restarts the group as a joiner.
    """

    def __init__(self, epoch: int, reason: str) -> None:
        super().__init__(
            f"this replica was evicted at membership epoch {epoch} ({reason}); it exits and "
            "its torchrun restarts it as a joining replica"
        )
        self.epoch = epoch
        self.reason = reason


class ReplicaTaken(RuntimeError):
    """Another process holds this replica id: a warm spare took it over (docs/live-membership.md
    §6.3). Raised before this process says hello as the replica; the front door then makes it
    a spare, waiting to take over a replica that is lost later."""

    def __init__(self, replica: int, group_rank: int, owner: str) -> None:
        super().__init__(
            f"replica {replica} rank {group_rank} was taken over by another process "
            f"(incarnation {owner}); this process becomes a warm spare"
        )
        self.replica = replica
        self.group_rank = group_rank
        self.owner = owner


class CoordinatorLost(RuntimeError):
    """The coordinator is silent or unreachable; the job falls back to a whole-job restart."""


class RunFinished(RuntimeError):
    """Every member finished training before this process could join (a replica restarted
    after the end of the run): there is nothing left to train. The front door exits 0."""

    def __init__(self, epoch: int, step: int, cause: str) -> None:
        super().__init__(
            f"the run finished at step {step} (membership epoch {epoch}: {cause}) before this "
            "process joined; nothing is left to train"
        )
        self.epoch = epoch
        self.step = step


class MembershipView(Protocol):
    """One worker's view of the live membership (one thread; the caller's)."""

    @property
    def keys(self) -> Keys: ...

    @property
    def epoch(self) -> int: ...

    @property
    def members(self) -> tuple[int, ...]:
        """Replica ids of the current epoch, sorted."""
        ...

    @property
    def replica(self) -> int:
        """This process's replica id (``LMR_REPLICA_GROUP``)."""
        ...

    @property
    def replicas(self) -> int:
        """R, the replica count of a full world (``LMR_REPLICA_GROUPS``)."""
        ...

    @property
    def incarnation(self) -> str:
        """This process's incarnation (uuid4 hex), carried in its ``Ack`` for fencing."""
        ...

    @property
    def group_rank(self) -> int:
        """This process's rank inside its replica group (torchrun's ``RANK``)."""
        ...

    def store(self) -> dist.Store:
        """A coordinator-store client owned by the calling thread (never shared)."""
        ...

    def failed(self) -> str | None:
        """The cause if the current epoch has failed (``fail/<E>`` exists or was seen).

        Called from the cross-replica group's watcher thread too (use that thread's own
        store client), every poll slice while a collective is pending.
        """
        ...

    def report_failure(self, reason: str) -> None:
        """Publish ``fail/<E>`` for the current epoch unless someone already did.

        Called from the watcher thread (its own store client).
        """
        ...

    def reform(self, ack: Ack) -> EpochRecord:
        """Acknowledge the failed epoch and wait (bounded) for the next one; adopt it.

        Raises :class:`Evicted` when this replica is not in the new members, and
        :class:`CoordinatorLost` when no record comes within ``reform_timeout_s``.
        """
        ...


class BelowMinReplicas(CoordinatorLost):
    """The new epoch has no members: fewer than ``min_replicas`` replicas survived.

    Like a lost coordinator, the job falls back to a whole-job restart with memory recovery.
    """

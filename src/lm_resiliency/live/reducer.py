"""``LiveReducer``: MTGS's :class:`~lm_resiliency.transactions.reducer.Reducer` over the epoch's
cross-replica group, rebuilt at every membership change.

Call order (training thread)::

    reducer = LiveReducer(membership)                 # builds epoch E's group (collective)
    txn = MTGS(ddp, opt, reducer=reducer)             # the hook reduces through it
    ...                                               # a lost replica: MTGS calls
    reducer.reform(report)                            # ack, wait for E+1, rebuild the group
    ...                                               # an admission at a step boundary:
    reducer.adopt(record)                             # the epoch heal.at_boundary returned

``weight_fn(members, replica)`` gives this replica's share of the global batch
(``n_i / B``, docs/live-membership.md §5); the default is an equal share ``1/len(members)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from lm_resiliency.live.group import CrossReplicaGroup
from lm_resiliency.live.keys import Ack, EpochRecord
from lm_resiliency.live.view import MembershipView
from lm_resiliency.transactions.reducer import LossReport, Reformed

__all__ = ["LiveReducer", "WeightFn", "equal_share"]

WeightFn = Callable[[tuple[int, ...], int], float]
"""``(members, replica) -> weight``: this replica's share of the global batch."""


def equal_share(members: tuple[int, ...], replica: int) -> float:
    """``1/len(members)``: every member computes the same number of samples."""
    return 1.0 / len(members)


class LiveReducer:
    """Reduces over the current epoch's :class:`CrossReplicaGroup`; see the module doc.

    Construct on every member of the current epoch at the same point (building the group
    is collective). Raises what :meth:`CrossReplicaGroup.build` raises.
    """

    live = True

    def __init__(
        self,
        view: MembershipView,
        weight_fn: WeightFn = equal_share,
        *,
        poll_slice_s: float = 0.05,
        pg_timeout_s: float = 30.0,
        backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.view = view
        self.backend = backend
        self.device = device
        self.weight_fn = weight_fn
        self.poll_slice_s = poll_slice_s
        self.pg_timeout_s = pg_timeout_s
        self.last_reform_s = 0.0
        """Wall time of the last :meth:`reform` (ack, wait for the record, rebuild)."""
        self.last_build_s = 0.0
        """Wall time of the last group build alone."""
        self.group = self._adopt(
            CrossReplicaGroup.build(
                view,
                epoch=view.epoch,
                members=view.members,
                poll_slice_s=poll_slice_s,
                pg_timeout_s=pg_timeout_s,
                backend=backend,
                device=device,
            )
        )

    @property
    def epoch(self) -> int:
        return self.group.epoch

    @property
    def slot(self) -> int:
        return self.view.replica

    @property
    def slots(self) -> int:
        return self.view.replicas

    @property
    def members(self) -> tuple[int, ...]:
        return self.group.members

    @property
    def weight(self) -> float:
        return self._weight

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return self.group.allreduce(tensor)

    def wait(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        return self.group.wait(future)

    def reform(self, report: LossReport) -> Reformed:
        """Abandon this epoch's group, acknowledge, adopt the next epoch and build its group.

        Raises ``Evicted`` (not a member any more) and ``CoordinatorLost`` from the view.
        """
        t0 = time.perf_counter()
        failed = self.group.failure()
        if failed is None:
            # MTGS took another communication error for a loss: make the peers leave too.
            self.view.report_failure("a member's collective failed outside the group")
        self.group.abandon(failed.cause if failed is not None else "membership change")
        ack = Ack(
            inc=self.view.incarnation,
            committed=report.committed,
            applied=report.applied,
            shadow_of=report.shadow_of,
            in_flight=report.in_flight,
            pid=os.getpid(),
        )
        try:
            record = self.view.reform(ack)
        except BaseException:
            self.group.close()  # no successor: a kept NCCL communicator is aborted now
            raise
        # A new group, or on NCCL the failed communicator shrunk to the survivors.
        self.group = self._adopt(self.group.successor(epoch=record.epoch, members=record.members))
        self.last_reform_s = time.perf_counter() - t0
        return Reformed(epoch=record.epoch, members=record.members, resume_step=record.resume_step)

    def adopt(self, record: EpochRecord) -> None:
        """Rebuild the group for ``record``, an epoch adopted at a step boundary (collective).

        The outcome of an admission (``heal.at_boundary``): the joiner admitted, the admission
        cancelled, or a loss during it. No step is in flight, so this epoch's group is
        abandoned without a failure report, and the members of ``record`` build its group.
        """
        if record.epoch == self.group.epoch:
            return
        t0 = time.perf_counter()
        self.group.abandon(f"membership epoch {record.epoch} ({record.reason})")
        self.group = self._adopt(self.group.successor(epoch=record.epoch, members=record.members))
        self.last_reform_s = time.perf_counter() - t0

    def _adopt(self, group: CrossReplicaGroup) -> CrossReplicaGroup:
        members = group.members
        self.last_build_s = group.build_s
        self._weight = float(self.weight_fn(members, self.view.replica))
        if not 0.0 < self._weight <= 1.0:
            raise ValueError(
                f"weight_fn{(members, self.view.replica)} returned {self._weight}; a replica's "
                "share of the global batch must be in (0, 1] (n_i / B)"
            )
        return group

"""The DDP communication hook that carries the MTGS vote inside the gradient all-reduce.

Register it on a ``DistributedDataParallel`` model (``MTGS`` does this for you)::

    state = MTGSState()
    ddp_model.register_comm_hook(state, mtgs_comm_hook)

For every bucket the hook does what DDP's default all-reduce does (divide by
the world size, all-reduce with SUM) plus two cheap things:

* it adds the bucket's local sum to a running device scalar (no ``.item()``,
  no synchronisation): a non-finite sum means a non-finite local gradient, so
  the vote can name the rank it came from;
* on the last bucket of the synchronised backward pass (``bucket.is_last()``;
  with gradient accumulation the last micro-batch's, the others run under
  ``DDP.no_sync()`` and reduce nothing) it appends a
  vector of ``world_size`` slots to the flattened bucket; this rank writes its
  abort code into its own slot and zero elsewhere, so after the SUM every rank
  holds every rank's code. The vote costs no extra collective and no extra
  copy: the last bucket is divided by the world size straight into a packed
  buffer kept across steps (instead of in place), the vote slots at its end.

With a *live* reducer (``MTGSState(reducer=...)``, docs/live-membership.md §4.1) the
bucket is pre-scaled by the reducer's sample weight instead, reduced through the reducer's
polled future, and the vote vector has ``2*slots`` entries: the code in slot ``r`` and the
epoch mark in slot ``slots + r``. The default reducer takes today's path unchanged.

The codes are read once per step, after ``backward()`` returned (DDP has waited
for every bucket by then), by :meth:`MTGSState.reduced_codes`.

Soundness: the vote rides on collectives every rank must issue. A rank that
raises before its backward launched every bucket (an exception or OOM in the
forward or backward pass) would leave its peers blocked in the all-reduce, so
MTGS completes the missing collectives for it with zero gradients and its
unhealthy code (see :mod:`lm_resiliency.transactions.fallback`); no extra
collective is added to healthy steps.

This module deliberately does not use ``from __future__ import annotations``:
DDP checks the hook's ``bucket`` and return annotations against the real
``GradBucket`` and ``Future[Tensor]`` objects, which string annotations fail.
"""

from typing import cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from lm_resiliency.transactions.reasons import VOTE_REASONS_MAX, AbortReason
from lm_resiliency.transactions.reducer import GroupReducer, Reducer, epoch_mark


class MTGSState:
    """Per-rank state shared by :func:`mtgs_comm_hook` and the transaction.

    Create one per DDP model, before ``register_comm_hook``. ``process_group``
    must be the DDP model's group (default: the default group). The
    transaction calls :meth:`begin` before each attempt's backward pass and
    :meth:`reduced_codes` after it; the counters say how many all-reduces the
    hook launched (for the benchmark's collective count).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        carry_vote: bool = True,
        reducer: Reducer | None = None,
    ) -> None:
        self.process_group = process_group
        self.reducer: Reducer = reducer if reducer is not None else GroupReducer(process_group)
        """Where the buckets are reduced; a live reducer survives a lost replica."""
        self.live = self.reducer.live
        self.carry_vote = carry_vote
        """``False``: a plain mean all-reduce that only counts buckets (the hook-less ablation
        votes with an explicit collective instead)."""
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.bucket_allreduces = 0
        """All-reduces launched by the hook since construction (one per bucket per step)."""
        self.votes_carried = 0
        """Votes appended to a last bucket since construction."""
        self._pack: torch.Tensor | None = None
        self.begin()

    def begin(self) -> None:
        """Forget the previous attempt: no buckets seen, healthy, no reduced codes."""
        self.buckets_launched = 0
        self.vote_cast = False
        self.host_code = 0
        self._loss_bad: torch.Tensor | None = None
        self._health: torch.Tensor | None = None
        self._grad_sum: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None
        self.failure: BaseException | None = None
        """The first bucket all-reduce error of this attempt (a peer died or hung)."""

    def _result(self, f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            return f.value()[0]
        except Exception as exc:
            # DDP may not surface a failed bucket from backward(); remember it so the
            # vote reports the lost peer instead of a missing vote.
            if self.failure is None:
                self.failure = exc
            raise

    def mark(self, reasons: int) -> None:
        """Add vote-phase reasons known on the host (exception, forced abort, ...)."""
        if not 0 <= reasons < VOTE_REASONS_MAX:
            raise ValueError(f"vote code {reasons} is not a vote-phase AbortReason")
        self.host_code |= reasons

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Vote ``NONFINITE_LOSS`` if ``loss`` is not finite (checked on device, no sync).

        Called once per micro-batch when gradients are accumulated: the verdicts
        are folded (any non-finite micro-batch loss votes abort).
        """
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = (
            bad if self._loss_bad is None else self._loss_bad | bad.to(self._loss_bad.device)
        )

    def watch_health(self, healthy: torch.Tensor) -> None:
        """Vote ``HEALTH_CHECK`` if the boolean tensor ``healthy`` is false (on device).

        Folded over micro-batches like :meth:`watch_loss` (all must be healthy).
        """
        ok = healthy.detach().to(torch.bool).all()
        self._health = ok if self._health is None else self._health & ok.to(self._health.device)

    def reduced_codes(self) -> torch.Tensor | None:
        """The summed vote vector (slot r = rank r's code) or ``None`` if no vote was cast."""
        return self._reduced

    def _live_result(self, f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            return f.value()
        except Exception as exc:
            if self.failure is None:
                self.failure = exc  # the reducer's MembershipLoss, with its own type
            raise

    def _add_local_sum(self, buffer: torch.Tensor) -> None:
        acc = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        s = torch.sum(buffer, dtype=acc)
        self._grad_sum = s if self._grad_sum is None else self._grad_sum + s

    def _packed(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The last bucket's ``n`` elements plus ``world_size`` vote slots, kept across steps.

        One buffer per bucket shape: no allocation (and no page faults) per step. Reusing
        it is safe: DDP copies the reduced gradients out of it before ``backward()``
        returns and the vote slots are read right after, both before the next step's
        last bucket writes it again.
        """
        size = n + self.world_size
        buf = self._pack
        if buf is None or buf.numel() != size or buf.dtype != dtype or buf.device != device:
            buf = self._pack = torch.empty(size, dtype=dtype, device=device)
        return buf

    def _write_vote(self, slots: torch.Tensor, index: int | None = None) -> None:
        """Write this rank's abort code into slot ``index`` (default: its rank), zeros elsewhere."""
        # Device-side arithmetic only: reading the loss or the sums here would stall
        # the backward pass on a GPU. The bits are distinct, so sums never carry.
        slots.zero_()
        code = slots[self.rank if index is None else index]
        if self.host_code:
            code.fill_(float(self.host_code))
        if self._grad_sum is not None:
            bad = ~torch.isfinite(self._grad_sum)
            code.add_(bad.to(slots.dtype), alpha=float(AbortReason.NONFINITE_GRAD))
        if self._loss_bad is not None:
            bad = self._loss_bad.to(slots.device)
            code.add_(bad.to(slots.dtype), alpha=float(AbortReason.NONFINITE_LOSS))
        if self._health is not None:
            bad = ~self._health.to(device=slots.device, dtype=torch.bool)
            code.add_(bad.to(slots.dtype), alpha=float(AbortReason.HEALTH_CHECK))


def mtgs_comm_hook(state: MTGSState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one gradient bucket (mean over ranks) and carry the vote on the last one.

    Called by DDP on every rank for every bucket, in bucket order. Never reads a
    value back to the host and never touches other buckets or the parameters.
    The last bucket is divided straight into the packed buffer (one pass, as the
    in-place division of the other buckets), so carrying the vote costs no copy.
    """
    if state.live:
        return _live_bucket(state, bucket)
    buffer = bucket.buffer()
    if state.carry_vote:
        state._add_local_sum(buffer)
    if not (state.carry_vote and bucket.is_last()):
        buffer.div_(state.world_size)
        fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
        state.buckets_launched += 1
        state.bucket_allreduces += 1
        return cast(torch.futures.Future[torch.Tensor], fut.then(state._result))

    n = buffer.numel()
    packed = state._packed(n, buffer.dtype, buffer.device)
    torch.div(buffer, state.world_size, out=packed[:n])
    state._write_vote(packed[n:])
    fut = dist.all_reduce(packed, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
    state.buckets_launched += 1
    state.bucket_allreduces += 1
    state.votes_carried += 1
    state.vote_cast = True

    def unpack(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = state._result(f)
        state._reduced = reduced[n:]
        return reduced[:n]

    return cast(torch.futures.Future[torch.Tensor], fut.then(unpack))


def _live_bucket(state: MTGSState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The live reducer's bucket: pre-scaled by the sample weight, ``2*slots`` vote slots."""
    buffer = bucket.buffer()
    reducer = state.reducer
    if state.carry_vote:
        state._add_local_sum(buffer)
    state.buckets_launched += 1
    state.bucket_allreduces += 1
    if not (state.carry_vote and bucket.is_last()):
        buffer.mul_(reducer.weight)
        return reducer.allreduce(buffer).then(state._live_result)

    n, slots = buffer.numel(), reducer.slots
    # A fresh buffer per step, not the kept one of the default path: an abandoned epoch's
    # all-reduce may still be running in the graveyard (live/group.py) and write into the
    # tensor it was given while the step is redone under the next epoch.
    packed = torch.empty(n + 2 * slots, dtype=buffer.dtype, device=buffer.device)
    torch.mul(buffer, reducer.weight, out=packed[:n])
    state._write_vote(packed[n : n + slots], reducer.slot)
    marks = packed[n + slots :]
    marks.zero_()
    marks[reducer.slot] = epoch_mark(reducer.epoch)
    # Counted before the launch: a live reducer never raises here (a failure is set on
    # the future), so the vote has left once allreduce is called.
    state.votes_carried += 1
    state.vote_cast = True
    fut = reducer.allreduce(packed)

    def unpack(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = state._live_result(f)
        state._reduced = reduced[n:]
        return reduced[:n]

    return fut.then(unpack)

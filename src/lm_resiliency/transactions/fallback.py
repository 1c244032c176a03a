"""Finish a failed rank's share of a step's collectives so its peers never block.

Folding the vote into the gradient all-reduce is only sound if every rank
issues the same collectives in the same order. A rank whose forward or
backward pass raised (an exception, an out-of-memory error) stops issuing
them, and its healthy peers would wait in the all-reduce until the process
group times out. This module issues, on the failed rank only, exactly what
the rest of the step would have issued:

1. for every DDP forward of the attempt it never entered (one per micro-batch
   when gradients are accumulated): what ``DDP.forward`` does before the
   module runs (the one-time bucket rebuild broadcast, the buffer broadcast
   when ``broadcast_buffers`` applies);
2. for every DDP forward that did not finish: the post-forward buffer
   broadcast when a buffer hook asks for it;
3. every gradient bucket not yet launched, filled with zeros and sent through
   the registered comm hook, so the last one carries this rank's abort code.

These are DDP's own "join" primitives (the ones ``DDP.join()`` uses to shadow
the collectives of ranks that ran out of data), called directly; they are
private, so :func:`check_supported` verifies them when MTGS is constructed.
The gradients sent are zeros and never applied: the vote aborts the step on
every rank. Healthy steps pay nothing for this; no collective is added.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.errors import ConfigError

_REDUCER_API = (
    "_get_zeros_like_grad_buckets",
    "_run_comm_hook",
    "_rebuild_buckets",
    "_reset_state",
)
_DDP_API = ("_check_sync_bufs_pre_fwd", "_check_sync_bufs_post_fwd", "_sync_buffers")


def check_supported(ddp: DistributedDataParallel) -> None:
    """Raise ``ConfigError`` if this DDP model cannot be completed safely after a fault."""
    missing = [n for n in _REDUCER_API if not hasattr(ddp.reducer, n)]
    missing += [n for n in _DDP_API if not hasattr(ddp, n)]
    if missing:
        raise ConfigError(
            f"this torch {torch.__version__} DDP lacks {', '.join(missing)}, which MTGS needs "
            "to complete a failed rank's collectives; use torch >= 2.4"
        )
    if ddp.find_unused_parameters:
        raise ConfigError(
            "MTGS does not support DDP(find_unused_parameters=True): the unused-parameter "
            "all-reduce cannot be completed for a failed rank; construct DDP without it"
        )
    if ddp.static_graph:
        raise ConfigError(
            "MTGS does not support DDP(static_graph=True): an aborted backward pass is an "
            "error under a static graph; construct DDP with static_graph=False"
        )
    if getattr(ddp, "_use_python_reducer", False) or getattr(
        ddp, "_delay_all_reduce_all_params", False
    ):
        raise ConfigError(
            "MTGS needs DDP's C++ reducer; the python reducer (compiled autograd) and "
            "delay_all_reduce_named_params are not supported"
        )


class ForwardProbe:
    """Tracks how far the DDP forwards of the current attempt got (three module hooks).

    ``calls``: DDP forwards entered this attempt (one per micro-batch);
    ``module_entered``: the latest forward's pre-forward collectives finished
    and the wrapped module started; ``finished``: DDP forwards that returned
    (their post-forward work is done).
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.calls = 0
        self.module_entered = False
        self.finished = 0
        self._handles = [
            ddp.register_forward_pre_hook(self._on_enter),
            ddp.module.register_forward_pre_hook(self._on_module),
            ddp.register_forward_hook(self._on_exit),
        ]

    def reset(self) -> None:
        """Call before each attempt."""
        self.calls = 0
        self.module_entered = False
        self.finished = 0

    @property
    def entered(self) -> bool:
        return self.calls > 0

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()

    def _on_enter(self, module: Any, args: Any) -> None:
        self.calls += 1
        self.module_entered = False

    def _on_module(self, module: Any, args: Any) -> None:
        self.module_entered = True

    def _on_exit(self, module: Any, args: Any, output: Any) -> None:
        self.finished += 1


def grad_marks(ddp: DistributedDataParallel) -> dict[int, tuple[int, int]]:
    """``id(param) -> (id(grad), grad._version)`` before a synchronised backward pass.

    Without a comm hook nothing counts the buckets DDP launched; a bucket is
    launched once every one of its parameters' gradients was accumulated, which
    changes the gradient object or its version counter (AccumulateGrad runs just
    before DDP's readiness hook). Only taken when MTGS registered no hook.
    """
    return {
        id(p): (id(p.grad), p.grad._version) for p in ddp.module.parameters() if p.grad is not None
    }


def _launched(buckets: list[Any], marks: dict[int, tuple[int, int]] | None) -> int:
    """The leading buckets whose every gradient was accumulated since ``marks`` was taken."""
    if marks is None:  # the synchronised backward never started
        return 0

    def ready(p: torch.Tensor) -> bool:
        g = p.grad
        return g is not None and marks.get(id(p)) != (id(g), g._version)

    n = 0
    # DDP's reducer launches buckets strictly in index order, each once it is complete.
    while n < len(buckets) and all(ready(p) for p in buckets[n].parameters()):
        n += 1
    return n


def complete_collectives(
    ddp: DistributedDataParallel,
    probe: ForwardProbe,
    buckets_launched: int | None,
    *,
    forwards: int = 1,
    grad_marks: dict[int, tuple[int, int]] | None = None,
) -> int:
    """Issue the rest of this attempt's collectives on a rank whose step raised.

    Call on the failed rank only, after the exception, with grad mode enabled
    (as the training step had it) and the rank's abort code already marked on
    the hook state. ``forwards`` is the number of DDP forwards every healthy
    rank runs this attempt (one per micro-batch; all but the last under
    ``no_sync()``). Blocks until the zero buckets are reduced (bounded by the
    process group's timeout). Returns the number of bucket all-reduces issued.
    ``buckets_launched=None`` (no MTGS hook counted them): derived from
    ``grad_marks`` (:func:`grad_marks` taken before the synchronised backward;
    ``None``: that backward never started).
    """
    for j in range(probe.finished, forwards):
        if j >= probe.calls:
            # Mirrors DDP._pre_forward: the rebuild is a no-op except on the one
            # forward where every rank broadcasts the rebuilt bucket order.
            if torch.is_grad_enabled():
                ddp.reducer._rebuild_buckets()
            if ddp._check_sync_bufs_pre_fwd():  # type: ignore[no-untyped-call]
                ddp._sync_buffers()  # type: ignore[no-untyped-call]
        if ddp._check_sync_bufs_post_fwd():  # type: ignore[no-untyped-call]
            ddp._sync_buffers()  # type: ignore[no-untyped-call]
        # What DDP._post_forward leaves behind: only the synced (last) forward asks
        # the next forward to broadcast buffers again.
        ddp.require_forward_param_sync = j == forwards - 1
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    if buckets_launched is None:
        buckets_launched = _launched(buckets, grad_marks)
    futures = [ddp.reducer._run_comm_hook(b) for b in buckets[buckets_launched:]]
    for fut in futures:
        fut.wait()
    return len(futures)


def reset_reducer(ddp: DistributedDataParallel) -> None:
    """Let the next forward run although a backward pass stopped half-way.

    Must be called on every rank of the step (the reducer then rebuilds its
    buckets once more, with a broadcast every rank takes part in).
    """
    ddp.reducer._reset_state()

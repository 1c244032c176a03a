"""DistributedDataParallel: the adapter enable_resiliency uses, and bit-identical resumption.

Why a restored DDP run drifts: DDP packs gradients into buckets and all-reduces
each bucket as one flat tensor. A freshly built DDP lays out its buckets in
reverse parameter-registration order; after its first backward it rebuilds them
once, in the order gradients actually became ready, and keeps that layout for
the rest of training. A collective such as Gloo's ring all-reduce adds up each
element in an order set by the element's position in the flat tensor, so the
same gradients in another layout round differently in the last bits. A run
resumed from a bit-exact checkpoint therefore takes its first step with the
*initial* layout while the uninterrupted run used the *rebuilt* one, and the two
diverge from there.

:class:`DDPAdapter` (what ``enable_resiliency`` uses) needs nothing from the
user: it records the gradient-ready order of the first backward pass, captures
it with every checkpoint, and after a restore replays it through the reducer's
own hooks so the next forward rebuilds the uninterrupted run's buckets (see
:mod:`lm_resiliency.integrations._ddp_buckets` for how, and which DDP
configurations are rejected).

:func:`prime_ddp_buckets` is the older, manual way for code that drives the
manager itself: it runs one discarded forward/backward right after the DDP
module is built from restored state, so DDP records the ready order and
rebuilds the same buckets at the next forward. Everything the discarded pass
touches (gradients, buffers such as BatchNorm statistics, the torch RNG that
dropout draws from) is put back, and no optimizer step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.detection.groups import DDP_GROUP_SIZE, bounded_replica_groups
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._ddp_buckets import (
    ReadyOrder,
    check_replayable,
    needs_replay,
    reducer_params,
    replay_ready_order,
    restore_grads,
)
from lm_resiliency.integrations.base import ParallelLayout
from lm_resiliency.integrations.module import ModuleAdapter

__all__ = ["DDPAdapter", "make_adapter", "prime_ddp_buckets"]

log = logging.getLogger(__name__)


class DDPAdapter(ModuleAdapter):
    """A ``DistributedDataParallel`` model: the wrapped module, the optimizers, the bucket order.

    Construct before the first forward after the DDP was built (the recorder
    must see the first backward pass). ``load_state_dict`` is collective: it
    replays the captured gradient-ready order (one all-reduce of zero buckets).
    Raises ``ConfigError`` for DDP configurations whose resumed layout cannot
    be re-established (``static_graph=True``, the Python reducer).
    """

    framework = "ddp"

    def __init__(
        self, ddp: DistributedDataParallel, optimizers: Sequence[torch.optim.Optimizer]
    ) -> None:
        super().__init__(ddp.module, optimizers)
        self.ddp = ddp
        check_replayable(ddp)
        self._replay = needs_replay(ddp)
        self._recorder = ReadyOrder(reducer_params(ddp)) if self._replay else None
        self._restored: list[int] | None = None

    def ready_order(self) -> list[int]:
        """The gradient-ready order this run's buckets follow ([] when DDP never rebuilds)."""
        if self._recorder is not None and self._recorder.order is not None:
            if self._restored is not None and self._recorder.order != self._restored:
                log.warning(
                    "DDP's gradient-ready order changed after the restore (%s -> %s); the "
                    "buckets follow the restored one",
                    self._restored,
                    self._recorder.order,
                )
                self._recorder.order = list(self._restored)
            return list(self._recorder.order)
        return list(self._restored) if self._restored is not None else []

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ddp"] = {"ready_order": self.ready_order()}
        return state

    def capture_state(self) -> dict[str, Any]:
        state = super().capture_state()
        state["ddp"] = {"ready_order": self.ready_order()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        order = list(state.get("ddp", {}).get("ready_order", []))
        if self._replay and not order:
            log.warning(
                "the checkpoint holds no DDP gradient-ready order (its first backward pass "
                "marked a parameter ready twice); the first resumed step may round differently"
            )
        if self._replay and order:
            if self._restored is not None and not getattr(self.ddp, "_has_rebuilt_buckets", True):
                # Restored twice before a forward (a hang's sweep applies the latest step,
                # then verified recovery an older one): the reducer already holds the
                # replayed order, and a second replay would record every parameter twice.
                if order != self._restored:
                    log.warning(
                        "a second restore before the first forward carries another DDP "
                        "gradient-ready order (%s, kept %s); the first resumed step may round "
                        "differently",
                        order,
                        self._restored,
                    )
                return
            replay_ready_order(self.ddp, order)
            self._restored = order

    def parallel_layout(self) -> ParallelLayout:
        """Every rank of DDP's process group holds a replica of the same parameters.

        SCOUT compares them in groups of ``DDP_GROUP_SIZE`` consecutive ranks (its
        exchange then does not grow with the job; docs/scout.md).
        """
        if not dist.is_initialized():
            return ParallelLayout()
        ranks = tuple(dist.get_process_group_ranks(self.ddp.process_group))
        if len(ranks) < 2:
            return ParallelLayout()
        return ParallelLayout(comparison_groups=bounded_replica_groups(ranks, DDP_GROUP_SIZE))

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()


def make_adapter(
    ddp: DistributedDataParallel, optimizers: Sequence[torch.optim.Optimizer], **options: Any
) -> DDPAdapter:
    """The registry's factory; ``options`` must be empty."""
    if options:
        raise ConfigError(f"the DDP adapter takes no options, got {sorted(options)}")
    return DDPAdapter(ddp, optimizers)


def prime_ddp_buckets(
    model: DistributedDataParallel,
    loss_fn: Callable[[DistributedDataParallel], torch.Tensor],
) -> None:
    """Give a freshly built DDP module the bucket layout of an uninterrupted run.

    Call once on every rank, after building ``model`` around parameters restored
    from a checkpoint and before its first training step (it all-reduces, so all
    ranks must call it together). ``loss_fn(model)`` must run a forward pass and
    return a scalar loss, like a training step without ``backward`` or
    ``optimizer.step``; any representative batch works (its result is
    discarded), and it must use the same modules and parameters as a training
    step so the recorded gradient order is the training order.

    Guarantees: parameters, optimizer state, gradients (values, or ``None``),
    module buffers and the CPU and CUDA torch RNG states are as before the call;
    the next training step uses the buckets the uninterrupted run used from its
    second step on, so resumed training is bit-identical when the restored state
    is. Costs one forward, one backward and one gradient all-reduce. Calling it
    on a module that has already trained a step does no harm (DDP rebuilds its
    buckets only once). Python's and NumPy's RNGs are not touched by DDP and are
    not saved; ``loss_fn`` must not draw from them. Raises ``TypeError`` when
    ``model`` is not a ``DistributedDataParallel``, ``ValueError`` when
    ``loss_fn`` returns a non-scalar or a tensor without a gradient.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"prime_ddp_buckets needs a DistributedDataParallel module, got "
            f"{type(model).__name__}; wrap the model in DDP first"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with torch.enable_grad():
            loss = loss_fn(model)
            if loss.dim() != 0 or not loss.requires_grad:
                raise ValueError(
                    f"loss_fn returned a tensor of shape {tuple(loss.shape)} with "
                    f"requires_grad={loss.requires_grad}; return the scalar training loss"
                )
            loss.backward()
    finally:
        restore_grads(params, grads)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

"""Bit-identical resumption of DistributedDataParallel training.

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

:func:`prime_ddp_buckets` runs one discarded forward/backward right after the
DDP module is built from restored state, so DDP records the ready order and
rebuilds the same buckets at the next forward, exactly as the uninterrupted run
did after its first step. Everything the discarded pass touches (gradients,
buffers such as BatchNorm statistics, the torch RNG that dropout draws from) is
put back, and no optimizer step runs, so the resumed run continues from the
restored state with the uninterrupted run's bucket layout.

Alternatives considered: ``static_graph=True`` still rebuilds after the first
iteration; ``find_unused_parameters=True`` never rebuilds, but it changes the
layout of the uninterrupted run too and costs a graph traversal every step;
DDP has no public way to build a module with a given bucket order, and setting
its reducer's private state is exactly the monkey-patching this library avoids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["prime_ddp_buckets"]


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
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)  # in place: the grad may be a view into a DDP bucket
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

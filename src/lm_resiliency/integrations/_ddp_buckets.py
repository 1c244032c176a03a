"""Record DDP's gradient-ready order and re-establish its bucket layout after a restore.

How DDP's reducer lays out buckets (torch/csrc/distributed/c10d/reducer.cpp):
a fresh DDP packs gradients in reverse registration order. During the first
backward pass that synchronises gradients, each parameter's autograd hook
(a post-hook on its ``AccumulateGrad`` node) appends the parameter to
``rebuilt_params_`` in the order its gradient became ready; the next forward
(``DDP._pre_forward`` -> ``reducer._rebuild_buckets()``) packs the buckets in
that order, once, broadcast from rank 0, and keeps them for the rest of the
run. Gloo's ring all-reduce sums each element in an order set by its position
in the flat bucket, so a resumed run whose first step uses the fresh layout
rounds differently from the uninterrupted one, which used the rebuilt layout.

What this module does instead of a user-supplied "priming" loss:

* :class:`ReadyOrder` records, with the public ``register_post_accumulate_grad_hook``
  of each parameter, the order in which gradients became ready in the first
  backward pass it sees (the same order the reducer recorded). The order is
  captured with every checkpoint (a list of ints).
* :func:`replay_ready_order`, right after a restore and before the first
  forward, runs the reducer's own bookkeeping through its public entry points:
  ``reducer.prepare_for_backward([])`` (what ``DDP._post_forward`` calls),
  then one backward pass per parameter, in the recorded order, of a zero
  gradient straight into the parameter's ``AccumulateGrad`` node. Each one
  fires DDP's autograd hook, so the reducer records exactly the recorded
  order, all-reduces the (zero) buckets once and finalises the pass as after
  any backward. Gradients are put back as they were. The next forward then
  rebuilds the buckets the uninterrupted run used. No forward pass, no model
  input, no optimizer step; nothing of torch is patched or replaced.

Configurations and why they are handled the way they are:

* ``find_unused_parameters=True`` (without ``static_graph``): the reducer never
  rebuilds, so both runs use the fresh layout throughout: nothing to replay.
* ``static_graph=True``: the first iteration of a static graph also records
  how often each parameter's hook fires and delays its all-reduce to the end;
  a replay cannot know those counts for graphs that need ``static_graph``
  (reentrant checkpointing), and the first resumed step would otherwise use
  the fresh layout. Rejected with ``ConfigError`` (use ``static_graph=False``).
* the Python reducer (compiled autograd) does not use this reducer at all:
  rejected with ``ConfigError``.
* ``delay_all_reduce_named_params`` covering every parameter: no buckets, no
  rebuild: nothing to replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from lm_resiliency.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "ReadyOrder",
    "check_replayable",
    "reducer_params",
    "replay_ready_order",
    "restore_grads",
]


def reducer_params(ddp: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters DDP's reducer manages, in DDP's own order.

    Every module's own parameters in ``named_modules()`` order, those that
    require a gradient and are not in ``parameters_to_ignore``, shared ones
    once (the order ``DistributedDataParallel`` builds its reducer with).
    """
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: set[int] = set()
    out: list[torch.nn.Parameter] = []
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{name}" if module_name else name
            if not param.requires_grad or fqn in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            out.append(param)
    return out


def needs_replay(ddp: DistributedDataParallel) -> bool:
    """Whether this DDP rebuilds its buckets after its first backward (so a resume must replay)."""
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return False
    return not (ddp.find_unused_parameters and not ddp.static_graph)


def check_replayable(ddp: DistributedDataParallel) -> None:
    """Raise ``ConfigError`` for a DDP whose resumed bucket layout cannot be re-established."""
    if ddp.static_graph:
        raise ConfigError(
            "DistributedDataParallel(static_graph=True) is not supported by enable_resiliency: "
            "its first step after a restore would use another gradient bucket layout than "
            "the uninterrupted run and drift in the last bits (a static graph's first "
            "iteration cannot be replayed without the model); construct DDP with "
            "static_graph=False"
        )
    if getattr(ddp, "_use_python_reducer", False):
        raise ConfigError(
            "DDP's Python reducer (compiled autograd) is not supported by enable_resiliency: "
            "its bucket layout after a restore cannot be re-established; use the default "
            "C++ reducer"
        )


class ReadyOrder:
    """Records the gradient-ready order of the first backward pass after construction.

    ``order`` is ``None`` until every managed parameter's gradient became
    ready once; then it is the list of indices into :func:`reducer_params` in
    ready order and the hooks are removed. A pass in which a parameter becomes
    ready twice before all others did is not a plain backward (reentrant
    checkpointing): recording stops and ``irregular`` is set.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._count = len(params)
        self._seen: list[int] = []
        self._seen_set: set[int] = set()
        self.order: list[int] | None = None
        self.irregular = False
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_ready(param: torch.Tensor) -> None:
            if index in self._seen_set:
                self.irregular = True
                self.remove()
                return
            self._seen.append(index)
            self._seen_set.add(index)
            if len(self._seen) == self._count:
                self.order = list(self._seen)
                self.remove()

        return on_ready

    def remove(self) -> None:
        """Stop recording (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def replay_ready_order(ddp: DistributedDataParallel, order: Sequence[int]) -> bool:
    """Make ``ddp``'s next forward rebuild its buckets in ``order``; returns whether it replayed.

    Collective: every rank of the DDP's group calls it at the same point,
    after the restore and before the first forward (it all-reduces one set of
    zero gradient buckets). Gradients are left as before the call. Does
    nothing (returns ``False``) for a DDP that never rebuilds or has already
    rebuilt its buckets. Raises ``ConfigError`` when ``order`` does not name
    every managed parameter exactly once (the model changed).
    """
    check_replayable(ddp)
    params = reducer_params(ddp)
    if sorted(order) != list(range(len(params))):
        raise ConfigError(
            f"the captured DDP gradient-ready order names {len(order)} parameter(s) "
            f"but this DDP manages {len(params)}; restore onto the same model, with the "
            "same parameters requiring gradients"
        )
    if not needs_replay(ddp) or getattr(ddp, "_has_rebuilt_buckets", False):
        return False
    saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
    ddp.reducer.prepare_for_backward([])
    try:
        with torch.enable_grad():
            for i in order:
                p = params[i]
                torch.autograd.backward(p, torch.zeros_like(p))
    finally:
        restore_grads(params, saved)
    log.debug("replayed DDP gradient-ready order over %d parameters", len(params))
    return True


def restore_grads(params: Sequence[torch.Tensor], saved: Sequence[torch.Tensor | None]) -> None:
    """Put back each parameter's gradient as ``saved`` (a clone taken before) held it."""
    with torch.no_grad():
        for p, g in zip(params, saved, strict=True):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)  # in place: the grad may be a view into a DDP bucket

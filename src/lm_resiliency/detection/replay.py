"""Replay of one block on deterministic inputs, isolated from the training.

:func:`replay` calls the block through its normal call path (``module(*args)``:
its hooks run, so a fault that makes this rank compute the block wrongly shows
in the result), then differentiates with ``torch.autograd.grad`` and returns a
64-bit digest of the outputs, the input gradients and the parameter gradients.

Isolation (what the training cannot observe afterwards):

* RNG: the CPU generator and the block's accelerator generator are forked and
  seeded for the replay, so dropout stays **on** (the training's own kernels) with
  the same mask on every peer; the training's RNG streams continue untouched;
* buffers (BatchNorm running statistics, counters): saved before and written back
  after, including buffers the forward replaced by new tensors;
* gradients and the optimizer: ``autograd.grad`` returns gradients instead of
  accumulating them, so ``.grad`` and post-accumulate hooks (DDP's reducer) are
  never touched and no optimizer sees anything;
* determinism: ``torch.use_deterministic_algorithms(True, warn_only=True)`` and
  cuDNN's deterministic, non-benchmark mode for the replay, restored afterwards;
* module mode: unchanged (train mode stays train mode; ``eval`` would change
  BatchNorm to use running statistics, which legitimately differ between peers
  that do not synchronise buffers).

Inputs: floating-point tensors are seeded normal values of the recorded shape and
dtype (``requires_grad`` as recorded); integer tensors are seeded uniform values in
the range the source peer recorded (or zeros), booleans uniform; scalars are the
recorded values. Every peer draws the same values from the same seed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_resiliency.capture.buffers import restore_buffers, save_buffers
from lm_resiliency.detection.digest import digest_tensors
from lm_resiliency.detection.signature import CallSignature, Scalar, Seq, TensorArg


@dataclass(frozen=True)
class ReplayOutcome:
    """Digest and wall time of one replay, or the error that stopped it."""

    digest: int
    seconds: float
    error: str | None = None


def module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn
    was_cudnn = (cudnn.deterministic, cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        with warnings.catch_warnings():
            # warn_only: an op without a deterministic kernel warns instead of failing the
            # replay; a replay that is not reproducible is caught by the confirmation re-run.
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
        cudnn.deterministic, cudnn.benchmark = was_cudnn


@contextlib.contextmanager
def _seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    saved = save_buffers(module)
    try:
        yield
    finally:
        restore_buffers(saved)


@contextlib.contextmanager
def isolated(module: nn.Module, *, seed: int) -> Iterator[None]:
    """Everything the replay must not leak into training (see the module docstring)."""
    with (
        _buffers_restored(module),
        _seeded_rng(module_device(module), seed),
        _deterministic(),
        torch.enable_grad(),
    ):
        yield


def _materialize(
    spec: TensorArg | Scalar | Seq, device: torch.device, leaves: list[torch.Tensor]
) -> Any:
    if isinstance(spec, Scalar):
        return spec.value
    if isinstance(spec, Seq):
        items = [_materialize(i, device, leaves) for i in spec.items]
        return items if spec.kind == "list" else tuple(items)
    if spec.floating:
        base = spec.dtype if spec.dtype in (torch.float32, torch.float64) else torch.float32
        t = torch.randn(spec.shape, device=device, dtype=base).to(spec.dtype)
        if spec.requires_grad:
            t.requires_grad_(True)
            leaves.append(t)
        return t
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, device=device).bool()
    if spec.int_range is not None:
        low, high = spec.int_range
        return torch.randint(low, high, spec.shape, device=device, dtype=spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)


def draw_inputs(
    sig: CallSignature, device: torch.device
) -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
    """The replay's inputs for ``sig`` from the current RNG: ``(args, kwargs, leaves)``.

    ``leaves``: the floating-point inputs that require gradients, in order.
    """
    leaves: list[torch.Tensor] = []
    args = [_materialize(a, device, leaves) for a in sig.args]
    kwargs = {k: _materialize(v, device, leaves) for k, v in sig.kwargs}
    return args, kwargs, leaves


def flatten_tensors(value: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor in ``value`` (nested tuples, lists, dicts by key) to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            flatten_tensors(v, out)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            flatten_tensors(value[k], out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replay(module: nn.Module, sig: CallSignature, *, seed: int) -> ReplayOutcome:
    """Replay ``module`` on the inputs ``sig`` describes; isolated, deterministic, timed.

    Call at a step boundary (no training graph alive). Local: no collective.
    Never raises for a failure of the module itself: the error is returned.
    """
    device = module_device(module)
    params = [p for p in module.parameters() if p.requires_grad]
    try:
        with isolated(module, seed=seed):
            _sync(device)
            t0 = time.perf_counter()
            args, kwargs, leaves = draw_inputs(sig, device)
            enabled, dtype = sig.autocast
            cast = torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=enabled)
            with cast:
                out = module(*args, **kwargs)
            outputs: list[torch.Tensor] = []
            flatten_tensors(out, outputs)
            diff = [o for o in outputs if o.requires_grad and o.is_floating_point()]
            inputs = leaves + params
            grads: tuple[torch.Tensor | None, ...] = ()
            if diff and inputs:
                seeds = [torch.randn_like(o) for o in diff]
                grads = torch.autograd.grad(diff, inputs, seeds, allow_unused=True)
            value = digest_tensors([*outputs, *grads])
            _sync(device)
            seconds = time.perf_counter() - t0
    except Exception as exc:  # the module's own failure: reported, never raised into training
        return ReplayOutcome(0, 0.0, f"{type(exc).__name__}: {exc}")
    return ReplayOutcome(value, seconds)


def parameter_digest(params: tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter]) -> int:
    """Digest of parameter values (the optimizer recipe: post-step state of a block)."""
    with torch.no_grad():
        return digest_tensors([p.detach() for p in params])

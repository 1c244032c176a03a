"""TEST-ONLY: let Megatron Core 0.16 train on a CPU-only machine. Never imported by the product.

Megatron Core assumes CUDA in a few places that have nothing to do with what
the resiliency adapter captures or restores; on a machine without a GPU they
raise ``AssertionError: Torch not compiled with CUDA enabled``. ``install()``
patches exactly these, in the worker process only, before any model is built:

1. CUDA devices become the CPU: ``torch.cuda.current_device`` returns ``"cpu"``
   (DDP's grad/param buffers are allocated on ``torch.cuda.current_device()``),
   and a ``TorchFunctionMode`` (torch's public hook for intercepting torch
   calls), entered once for the whole process, rewrites a ``device="cuda"``
   argument to ``"cpu"`` and makes ``Tensor.cuda()`` return the tensor itself
   (the optimizer builds small flag tensors with ``device='cuda'``).
2. ``torch.cuda.get_rng_state``/``manual_seed`` and Megatron's own
   ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` act on
   the CPU generator: the CUDA RNG tracker (named states forked around dropout
   and initialization) keeps its states in the CPU generator instead of a GPU's.
   The tracker's bookkeeping, which the adapter captures, is unchanged.
3. ``torch.Tensor.type()`` (no arguments) reports a CPU float/half/bfloat16
   tensor as ``torch.cuda.FloatTensor``/``HalfTensor``/``BFloat16Tensor``: the
   optimizers sort params into fp32 and fp16/bf16 groups by that string and
   reject anything else. With arguments it is torch's own ``type``.
4. ``torch.cuda.current_stream``/``default_stream``/``synchronize``/
   ``empty_cache`` become no-ops (the gradient-sync code calls them).

Nothing else is changed: the distributed optimizer, DDP's buckets, the
parallel state and the Gloo collectives are Megatron's and torch's own code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}

_installed = False


class _NullStream:
    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def install() -> None:
    """Apply the patches listed in the module doc (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    _CudaToCpu().__enter__()  # for the rest of the process
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _NullStream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]

    original_type = torch.Tensor.type

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        return original_type(self, *args, **kwargs)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign,assignment]

    from megatron.core.tensor_parallel import random as mrandom

    def get_state(clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

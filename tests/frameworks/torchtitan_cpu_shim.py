"""TEST-ONLY: let TorchTitan 0.3.0's ``Trainer`` train on a CPU-only machine. Never in the product.

TorchTitan picks its device once, at import, from torch's available
accelerator (``cuda`` when there is none) and uses a compiled FlexAttention
kernel that has no CPU backward. Nothing here touches what the resiliency
adapter captures or restores. ``install()``, called in the worker process
before the Trainer is built, patches exactly:

1. ``triton``: three torchtitan modules (``overrides.fused_swiglu``,
   ``overrides.fused_mla``, ``distributed.minimal_async_ep.kernels``) import
   it at module level and the CPU wheel of torch has none. A stand-in module
   is placed in ``sys.modules`` only while those three are imported, after
   torch's own triton-probing modules (``torch._inductor``,
   ``torch._functorch.partitioners``, ...) were imported without it, then
   removed again, so torch never sees a triton.
2. The device: ``torchtitan.tools.utils.device_type``/``device_module`` (and
   every already-imported torchtitan module that bound them by name) become
   ``"cpu"`` and a small CPU device module: ``current_device() -> 0`` (a Gloo
   barrier takes an int device id), ``device_count() -> 1``,
   ``get_device_name``/``get_device_properties``/``memory_stats`` for the
   memory monitor and MFU logging, no-ops for ``set_device``/``synchronize``/
   ``empty_cache``/``reset_peak_memory_stats``.
3. FlexAttention: ``FlexAttention._compiled_flex_attn`` (a ``torch.compile``
   of ``flex_attention``, whose backward is not implemented on CPU) is
   replaced by ``scaled_dot_product_attention`` with the block mask
   materialized by ``create_mask``: the same masking (block-causal per
   document), a different kernel.
4. ``torch.distributed.set_timeout``: TorchTitan 0.3.0 calls it after the first
   step of a process (``set_pg_timeouts``) but torch 2.13.0 has no such
   function (a version skew, GPU or not); the shim provides it as torch's own
   ``distributed_c10d._set_pg_timeout`` (same arguments: timeout, group).

Configuration, not patches (the worker sets them through TorchTitan's own
config): ``parallelism.spmd_backend="partial_dtensor"`` (the default
``spmd_types`` path needs full-mesh DTensor params before ``fully_shard``),
``training.mixed_precision_param="float32"``, ``training.disable_cuda_graphs``,
a local tokenizer and dataset. And one public FSDP2 call after the Trainer is
built (:func:`force_sum_reduction`): TorchTitan sets a gradient divide factor
of 1, which FSDP2 reduces with ``PREMUL_SUM``, an op Gloo lacks;
``set_force_sum_reduction_for_comms(True)`` reduces with ``SUM`` (then x1.0).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

_installed = False

_TORCH_FIRST = (
    "torch._dynamo",
    "torch._inductor",
    "torch._inductor.codecache",
    "torch._inductor.compile_fx",
    "torch._functorch.partitioners",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.nn.attention.flex_attention",
)
_NEED_TRITON = (
    "torchtitan.overrides.fused_swiglu",
    "torchtitan.overrides.fused_mla",
    "torchtitan.distributed.minimal_async_ep.kernels",
)


class _Anything:
    """Stands for any triton object at import time (decorators return their function)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __getitem__(self, key: Any) -> Any:
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _Props:
    name = "cpu"
    total_memory = 1 << 34


class _CpuDevice:
    """What TorchTitan calls on its device module, answered for the CPU."""

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, *args: Any) -> str:
        return "cpu"

    def get_device_properties(self, *args: Any) -> _Props:
        return _Props()

    def memory_stats(self, *args: Any) -> dict[str, int]:
        return {
            "active_bytes.all.peak": 0,
            "reserved_bytes.all.peak": 0,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: None  # set_device, synchronize, empty_cache, ...


def _import_with_stub_triton() -> None:
    for name in _TORCH_FIRST:
        importlib.import_module(name)
    stubs = {n: _StubModule(n) for n in ("triton", "triton.language")}
    for stub in stubs.values():
        stub.__path__ = []
    stubs["triton"].language = stubs["triton.language"]  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        for name in _NEED_TRITON:
            importlib.import_module(name)
    finally:
        for name in stubs:
            del sys.modules[name]


def _cpu_devices() -> None:
    cpu = _CpuDevice()
    importlib.import_module("torchtitan.trainer")
    importlib.import_module("torchtitan.models.llama3.config_registry")
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu  # type: ignore[attr-defined]


def _sdpa_flex() -> None:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        score_mod: Any,
        block_mask: Any,
        scale: float | None,
        enable_gqa: bool,
        return_aux: Any,
        kernel_options: Any,
    ) -> tuple[torch.Tensor, Any]:
        if score_mod is not None or (return_aux is not None and return_aux.lse):
            raise NotImplementedError("the CPU shim's attention has no score_mod or lse")
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, types.SimpleNamespace(lse=None)

    FlexAttention._compiled_flex_attn = staticmethod(attention)  # type: ignore[assignment]


def install() -> None:
    """Apply the patches listed in the module doc (idempotent); before building the Trainer."""
    global _installed
    if _installed:
        return
    _installed = True
    _import_with_stub_triton()
    _cpu_devices()
    _sdpa_flex()
    if not hasattr(torch.distributed, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]


def force_sum_reduction(model_parts: list[torch.nn.Module]) -> None:
    """FSDP2's public switch from ``PREMUL_SUM`` (absent on Gloo) to ``SUM``; see the doc."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

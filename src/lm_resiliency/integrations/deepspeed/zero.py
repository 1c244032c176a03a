"""Where each DeepSpeed ZeRO optimizer keeps a rank's unique state; how to re-derive the rest.

Every ZeRO optimizer wraps a plain torch optimizer (``zero.optimizer``) that
steps this rank's fp32 master partitions, one flat tensor per param group
(ZeRO-1/2, the BF16 optimizer) or per sub-group (ZeRO-3). Those masters and
their optimizer state are what no other rank holds; everything else is derived
(DeepSpeed 0.19):

* ``DeepSpeedZeroOptimizer`` (ZeRO-1/2): masters ``single_partition_of_fp32_groups``;
  ``update_lp_params()`` rebuilds the low-precision partitions and all-gathers
  them (collective);
* ``BF16_Optimizer`` (ZeRO-1 with bf16 params and fp32 gradient accumulation):
  masters ``fp32_groups_flat_partition``; ``update_lp_params()`` (collective);
* ``DeepSpeedZeroOptimizer_Stage3``: masters ``fp32_partitioned_groups_flat``;
  the partitioned low-precision flats are copied from them, and
  ``checkpoint_event_epilogue()`` re-gathers the persistent (small) params.

Attribute names are DeepSpeed's (read, never replaced); the classes are matched
by name so that importing this module needs no DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import ConfigError

__all__ = ["ZeroView", "zero_view"]


@dataclass(frozen=True)
class ZeroView:
    """One ZeRO optimizer seen as: its inner torch optimizer, its masters, how to re-derive.

    ``inner_steps_per_step``: how many times one engine step calls
    ``inner.step()`` (once per param group or ZeRO-3 sub-group); the step
    boundary is after the last of them.
    """

    zero: Any
    kind: str
    stage: int
    inner: torch.optim.Optimizer
    masters: tuple[torch.Tensor, ...]
    inner_steps_per_step: int

    def rederive(self) -> None:
        """Collective over the data-parallel group: rebuild low-precision params from masters."""
        if self.kind == "stage3":
            for fp32, lp in zip(self.masters, self.zero.fp16_partitioned_groups_flat, strict=True):
                if fp32.numel() > 0:
                    lp.data.copy_(fp32.data)
            # Persistent (small) params stay gathered between steps: gather them anew.
            self.zero.checkpoint_event_epilogue()
        else:
            self.zero.update_lp_params()

    def before_restore(self) -> None:
        """ZeRO-3: release every gathered parameter so only partitions are live."""
        if self.kind == "stage3":
            self.zero.checkpoint_event_prologue()


def _names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def zero_view(zero: Any, stage: int) -> ZeroView:
    """The :class:`ZeroView` of a DeepSpeed engine's optimizer; ``ConfigError`` if unsupported."""
    names = _names(zero)
    if "DeepSpeedZeroOptimizer_Stage3" in names:
        masters = tuple(zero.fp32_partitioned_groups_flat)
        if any(flat is None for flat in zero.fp16_partitioned_groups_flat):
            raise ConfigError(
                "DeepSpeed ZeRO-3 with parameter offload to NVMe keeps no partition in "
                "memory; the resiliency adapter does not support offload_param yet"
            )
        kind, steps = "stage3", len(masters)
    elif "DeepSpeedZeroOptimizer" in names:
        masters = tuple(zero.single_partition_of_fp32_groups)
        kind, steps = "stage1_2", len(masters)
    elif "BF16_Optimizer" in names:
        masters = tuple(zero.fp32_groups_flat_partition)
        kind, steps = "bf16", 1
    else:
        raise ConfigError(
            f"the DeepSpeed engine's optimizer is a {type(zero).__name__}; the resiliency "
            "adapter supports ZeRO stages 1, 2 and 3 (zero_optimization.stage >= 1) and "
            "the BF16 optimizer"
        )
    inner = zero.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError(
            f"the ZeRO optimizer wraps a {type(inner).__name__}, not a torch.optim.Optimizer; "
            'use a torch optimizer (e.g. "optimizer": {"type": "AdamW", "params": '
            '{"torch_adam": true}}) or a client torch optimizer'
        )
    if getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False):
        raise ConfigError(
            "DeepSpeed optimizer offload (offload_optimizer) is not supported by the "
            "resiliency adapter yet; disable it"
        )
    if getattr(zero, "dtype", None) == torch.float16:
        raise ConfigError(
            "DeepSpeed fp16 with loss scaling is not supported by the resiliency adapter "
            "(its loss-scaler state is not captured); use bf16 or fp32"
        )
    return ZeroView(zero, kind, stage, inner, masters, steps)

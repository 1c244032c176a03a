"""DeepSpeed ZeRO-1/2/3 behind ``enable_resiliency(engine)``; imported only for an engine."""

from __future__ import annotations

from lm_resiliency.integrations.deepspeed.adapter import (
    DeepSpeedAdapter,
    durable_loader,
    make_adapter,
)

__all__ = ["DeepSpeedAdapter", "durable_loader", "make_adapter"]

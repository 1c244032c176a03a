"""TorchTitan behind ``enable_resiliency(trainer)``; imported lazily by the registry."""

from __future__ import annotations

from lm_resiliency.integrations.torchtitan.adapter import TorchTitanAdapter, make_adapter

__all__ = ["TorchTitanAdapter", "make_adapter"]

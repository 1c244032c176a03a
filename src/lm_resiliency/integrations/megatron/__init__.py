"""Megatron Core behind ``enable_resiliency(model_chunks, optimizer)``; imported lazily."""

from __future__ import annotations

from lm_resiliency.integrations.megatron.adapter import MegatronAdapter, make_adapter

__all__ = ["MegatronAdapter", "make_adapter"]

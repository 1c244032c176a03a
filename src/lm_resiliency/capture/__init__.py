"""Capture: layouts, host arenas, slots and the asynchronous copy engine."""

from __future__ import annotations

from lm_resiliency.capture.arena import allocate_arena, arena_is_pinned, populate
from lm_resiliency.capture.layout import Layout, TensorSpec, dtype_from_name, dtype_name

__all__ = [
    "Layout",
    "TensorSpec",
    "allocate_arena",
    "arena_is_pinned",
    "populate",
    "dtype_from_name",
    "dtype_name",
]

"""Validation of what ``enable_resiliency`` was given, alone and in combination.

Every check is local and runs before anything collective, so a bad argument
fails the same way on every rank instead of leaving peers waiting.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import Adapter
from lm_resiliency.transactions.config import MTGSConfig

__all__ = ["gemini_config", "check_mtgs", "check_scout"]

log = logging.getLogger(__name__)


def gemini_config(config: Any, interval: Any) -> InMemoryCkptConfig:
    """``config`` (default ``InMemoryCkptConfig()``) with ``interval`` as its capture cadence.

    ``interval`` overrides ``config.interval`` (the contract's unified call).
    """
    if config is not None and not isinstance(config, InMemoryCkptConfig):
        raise ConfigError(
            f"config must be an InMemoryCkptConfig, got {type(config).__name__}; e.g. "
            "config=InMemoryCkptConfig(disk_folder='/local/ckpt')"
        )
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(
            f"interval={interval!r} is invalid; use a positive number of optimizer steps "
            "between captures, e.g. interval=10"
        )
    base = config if config is not None else InMemoryCkptConfig()
    if base.interval != interval:
        log.info(
            "enable_resiliency: interval=%d overrides config.interval=%d", interval, base.interval
        )
    return dataclasses.replace(base, interval=interval)


def check_mtgs(mtgs: Any, adapter: Adapter) -> MTGSConfig | None:
    """MTGS needs a DDP model and exactly one optimizer; raises ``ConfigError`` otherwise."""
    if mtgs is None:
        return None
    if not isinstance(mtgs, MTGSConfig):
        raise ConfigError(
            f"mtgs must be an MTGSConfig, got {type(mtgs).__name__}; e.g. "
            "mtgs=MTGSConfig(max_retries=2)"
        )
    if adapter.framework != "ddp":
        raise ConfigError(
            f"mtgs=MTGSConfig(...) needs a DistributedDataParallel model (its vote rides in "
            f"DDP's gradient all-reduce), got a {adapter.framework!r} model; wrap the model "
            "in DDP or leave mtgs=None"
        )
    if len(adapter.step_optimizers()) != 1:
        raise ConfigError(
            f"mtgs=MTGSConfig(...) runs one optimizer per step, got "
            f"{len(adapter.step_optimizers())}; pass exactly one optimizer"
        )
    return mtgs


def check_scout(scout: Any) -> None:
    """SCOUT is not wired into ``enable_resiliency`` yet; only ``scout=None`` is accepted."""
    if scout is not None:
        raise ConfigError(
            f"scout={type(scout).__name__}(...) is not supported by this build of "
            "enable_resiliency yet; pass scout=None (a SCOUT check can run before each "
            "capture through handle.add_capture_gate)"
        )

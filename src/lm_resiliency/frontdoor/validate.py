"""Validation of what ``enable_resiliency`` was given, alone and in combination.

Every check is local and runs before anything collective, so a bad argument
fails the same way on every rank instead of leaving peers waiting.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection.scout_config import ScoutConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.frontdoor.resiliency_config import ResiliencyConfig
from lm_resiliency.integrations.base import Adapter
from lm_resiliency.transactions.mtgs_config import MTGSConfig

__all__ = ["check_mtgs", "check_scout", "gemini_config", "split_config"]

log = logging.getLogger(__name__)

_DEFAULT_INTERVAL = InMemoryCkptConfig.__dataclass_fields__["interval"].default


def describe_model(adapter: Adapter) -> str:
    """The model's type as a user wrote it, with the adapter that took it: ``MyNet (a plain
    nn.Module, adapter 'torch')``, for messages that refuse a combination."""
    try:
        first = adapter.modules()[0]
    except (NotImplementedError, IndexError):
        return f"a model of adapter {adapter.framework!r}"
    cls = type(first)
    return f"{cls.__module__}.{cls.__qualname__} (adapter {adapter.framework!r})"


def split_config(config: Any, mtgs: Any, scout: Any, live: Any = None) -> tuple[Any, Any, Any, Any]:
    """``(config, mtgs, scout, live)`` with a :class:`ResiliencyConfig` in ``config`` unpacked.

    A tier given both nested and as its own argument raises ``ConfigError`` (which one
    was meant cannot be guessed); anything else passes through for the checks below.
    """
    if not isinstance(config, ResiliencyConfig):
        return config, mtgs, scout, live
    for name, given, nested in (
        ("mtgs", mtgs, config.mtgs),
        ("scout", scout, config.scout),
        ("live", live, config.live),
    ):
        if given is not None and nested is not None:
            raise ConfigError(
                f"{name} is given twice, as {name}=... and as config=ResiliencyConfig("
                f"{name}=...); pass it once"
            )
    return (
        config.gemini,
        mtgs if mtgs is not None else config.mtgs,
        scout if scout is not None else config.scout,
        live if live is not None else config.live,
    )


def gemini_config(config: Any, interval: Any) -> InMemoryCkptConfig:
    """``config`` (default ``InMemoryCkptConfig()``) with ``interval`` as its capture cadence.

    ``interval`` overrides ``config.interval`` (docs/integration.md: one call); a
    warning says so only when the user set ``config.interval`` to something else
    (a config left at the field's default has no cadence of its own to lose).
    """
    if config is not None and not isinstance(config, InMemoryCkptConfig):
        raise ConfigError(
            f"config must be an InMemoryCkptConfig, got {type(config).__name__}; e.g. "
            "config=InMemoryCkptConfig(disk_folder='/local/ckpt') (or a "
            "ResiliencyConfig(gemini=..., mtgs=..., scout=...))"
        )
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(
            f"interval={interval!r} is invalid; use a positive number of optimizer steps "
            "between captures, e.g. interval=10"
        )
    base = config if config is not None else InMemoryCkptConfig()
    if base.interval not in (interval, _DEFAULT_INTERVAL):
        # Visible by default: a config built with its own interval and the call's default
        # interval=10 is the likely slip here.
        log.warning(
            "enable_resiliency: interval=%d overrides config.interval=%d (pass interval=%d to "
            "keep the config's cadence)",
            interval,
            base.interval,
            base.interval,
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
            f"DDP's gradient all-reduce), got {describe_model(adapter)}; wrap the model "
            "in DDP or leave mtgs=None"
        )
    if len(adapter.step_optimizers()) != 1:
        raise ConfigError(
            f"mtgs=MTGSConfig(...) runs one optimizer per step, got "
            f"{len(adapter.step_optimizers())}; pass exactly one optimizer"
        )
    return mtgs


def check_scout(scout: Any, adapter: Adapter) -> ScoutConfig | None:
    """``scout`` must be ``None`` or a ``ScoutConfig``; SCOUT needs replicas to compare.

    Raises ``ConfigError`` for another type, or when the model has no
    data-parallel replicas (a single process, or FSDP2 without a replicate
    dimension): SCOUT's comparison needs at least two ranks holding the same
    parameters.
    """
    if scout is None:
        return None
    if not isinstance(scout, ScoutConfig):
        raise ConfigError(
            f"scout must be a ScoutConfig, got {type(scout).__name__}; e.g. scout=ScoutConfig()"
        )
    if scout.enable and not adapter.parallel_layout().comparison_groups:
        raise ConfigError(
            f"scout=ScoutConfig(...) compares data-parallel replicas, but the model "
            f"{describe_model(adapter)} has none (one process, or sharded without a replicate "
            "dimension); train with DDP or HSDP, or leave scout=None"
        )
    return scout

"""``ResiliencyConfig``: the configurations of all three tiers as one value.

``enable_resiliency(model, optimizer, config=ResiliencyConfig(gemini=..., mtgs=..., scout=...,
live=...))`` is the same call as ``enable_resiliency(model, optimizer, config=..., mtgs=...,
scout=..., live=...)``;
today's separate arguments stay. A tier given both ways is refused (``ConfigError``), and
``interval=`` overrides ``gemini.interval`` as it overrides ``config.interval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm_resiliency._validate import validate
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection.scout_config import ScoutConfig
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.transactions.mtgs_config import MTGSConfig

__all__ = ["ResiliencyConfig"]


@dataclass(frozen=True, kw_only=True)
class ResiliencyConfig:
    """GEMINI's, MTGS's, SCOUT's and live membership's configurations; ``None``: the default.

    ``gemini=None`` is ``InMemoryCkptConfig()``; ``mtgs=None``, ``scout=None`` and
    ``live=None`` leave MTGS, SCOUT and live membership off, as their arguments do.
    """

    gemini: InMemoryCkptConfig | None = None
    """The in-memory checkpoint tier (``config=`` of ``enable_resiliency``)."""

    mtgs: MTGSConfig | None = None
    """MTGS step transactions (``mtgs=``)."""

    scout: ScoutConfig | None = None
    """SCOUT checks before every capture (``scout=``)."""

    live: LiveConfig | None = None
    """Live membership of data-parallel replica groups (``live=``; needs ``mtgs``)."""

    def __post_init__(self) -> None:
        validate(self, prefix="ResiliencyConfig.")

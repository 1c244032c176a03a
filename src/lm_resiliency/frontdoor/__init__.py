"""The front door: :func:`enable_resiliency` and the :class:`ResiliencyHandle` it returns.

See ``docs/integration.md`` for the integration per framework and what
"everything the next step depends on" means for common training loops.
"""

from __future__ import annotations

from lm_resiliency.frontdoor.boundary import BlockingStats, CaptureGate
from lm_resiliency.frontdoor.enable import enable_resiliency
from lm_resiliency.frontdoor.handle import ResiliencyHandle
from lm_resiliency.frontdoor.resiliency_config import ResiliencyConfig
from lm_resiliency.frontdoor.resume import RecoveryInfo

__all__ = [
    "BlockingStats",
    "CaptureGate",
    "RecoveryInfo",
    "ResiliencyConfig",
    "ResiliencyHandle",
    "enable_resiliency",
]

"""lm-resiliency: fast failure recovery for distributed PyTorch training.

Stable API: the entry point :func:`enable_resiliency` and the
:class:`ResiliencyHandle` it returns, the configurations
(:class:`InMemoryCkptConfig`, :class:`MTGSConfig`, :class:`ScoutConfig`,
:class:`LiveConfig`, and :class:`ResiliencyConfig` holding them all), the chunk-size estimator
(:func:`estimate_chunk_size`), recovery modes and the error hierarchy.
Low-level pieces live in :mod:`lm_resiliency.experimental`.
"""

from __future__ import annotations

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection.scout_config import ScoutConfig
from lm_resiliency.errors import (
    CaptureError,
    CheckpointFormatError,
    ConfigError,
    IdentityMismatch,
    IntegrityError,
    NoConsistentStep,
    RankFailures,
    ReplicationError,
    ResiliencyError,
    StateEncodingError,
    StepAborted,
)
from lm_resiliency.frontdoor import ResiliencyConfig, ResiliencyHandle, enable_resiliency
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.recovery.mode import RecoveryMode
from lm_resiliency.replication.chunking import estimate_chunk_size
from lm_resiliency.transactions.mtgs_config import MTGSConfig

__version__ = "0.3.0"

__all__ = [
    "CaptureError",
    "CheckpointFormatError",
    "ConfigError",
    "IdentityMismatch",
    "InMemoryCkptConfig",
    "IntegrityError",
    "LiveConfig",
    "MTGSConfig",
    "NoConsistentStep",
    "RankFailures",
    "RecoveryMode",
    "ReplicationError",
    "ResiliencyConfig",
    "ResiliencyError",
    "ResiliencyHandle",
    "ScoutConfig",
    "StateEncodingError",
    "StepAborted",
    "__version__",
    "enable_resiliency",
    "estimate_chunk_size",
]

"""lm-resiliency: fast failure recovery for distributed PyTorch training.

Stable API: the configuration (:class:`InMemoryCkptConfig`), the chunk-size
estimator (:func:`estimate_chunk_size`), recovery modes and the error hierarchy.
Low-level pieces live in :mod:`lm_resiliency.experimental`.
"""

from __future__ import annotations

from lm_resiliency.config import InMemoryCkptConfig
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
from lm_resiliency.recovery.mode import RecoveryMode
from lm_resiliency.replication.chunking import estimate_chunk_size

__version__ = "0.3.0"

__all__ = [
    "CaptureError",
    "CheckpointFormatError",
    "ConfigError",
    "IdentityMismatch",
    "InMemoryCkptConfig",
    "IntegrityError",
    "NoConsistentStep",
    "RankFailures",
    "RecoveryMode",
    "ReplicationError",
    "ResiliencyError",
    "StateEncodingError",
    "StepAborted",
    "__version__",
    "estimate_chunk_size",
]

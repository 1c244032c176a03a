"""SCOUT: replay-based detection of silent data corruption and stragglers.

Data-parallel peers replay the training's own blocks on identical deterministic
inputs and compare 64-bit digests bit for bit; timing outliers are stragglers.
The verdicts certify which GEMINI captures are safe (dense: at once; dynamic
catalogs: candidate, then verified) and choose the recovery step by failure
kind. See ``docs/scout.md``.
"""

from __future__ import annotations

from lm_resiliency.detection.decision import (
    FAILURE_KIND_ENV,
    FailureKind,
    RecoveryDecision,
    decide_mode,
    decide_recovery,
)
from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.recipes import DynamicCatalog
from lm_resiliency.detection.result import CHECK_EVENT, ScoutResult, ScoutStatus, Straggler
from lm_resiliency.detection.scout import Scout
from lm_resiliency.detection.scout_config import RecipeClass, ScoutConfig

__all__ = [
    "CHECK_EVENT",
    "FAILURE_KIND_ENV",
    "ComparisonGroups",
    "DynamicCatalog",
    "FailureKind",
    "RecipeClass",
    "RecoveryDecision",
    "Scout",
    "ScoutConfig",
    "ScoutResult",
    "ScoutStatus",
    "Straggler",
    "decide_mode",
    "decide_recovery",
]

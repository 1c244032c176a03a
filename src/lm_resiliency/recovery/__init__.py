"""Recovery: collective step selection and state loading across sources."""

from __future__ import annotations

from lm_resiliency.recovery.select import RecoveryMode, agree_on_step

__all__ = ["RecoveryMode", "agree_on_step"]

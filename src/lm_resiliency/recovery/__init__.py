"""Recovery: which steps each rank can obtain, the collective choice, and loading."""

from __future__ import annotations

from lm_resiliency.recovery.availability import Report, Source, gather_reports, source_options
from lm_resiliency.recovery.mode import RecoveryMode

__all__ = ["RecoveryMode", "Report", "Source", "gather_reports", "source_options"]

"""Recovery: which steps each rank can obtain, the collective choice, and loading.

Vocabulary: *recovery* is this layer's word (choosing and fetching a step); the manager
that drives it *restores* (:mod:`lm_resiliency.checkpointing.restore`), the front door
*resumes* (:mod:`lm_resiliency.frontdoor.resume`) and SCOUT makes the *recovery decision*
(:mod:`lm_resiliency.detection.decision`).
"""

from __future__ import annotations

from lm_resiliency.recovery.availability import Report, Source, gather_reports, source_options
from lm_resiliency.recovery.mode import RecoveryMode

__all__ = ["RecoveryMode", "Report", "Source", "gather_reports", "source_options"]

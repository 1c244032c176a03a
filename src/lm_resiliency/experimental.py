"""Low-level pieces without a stability promise (research and custom adapters).

The stable entry points live in :mod:`lm_resiliency`; these may change between
releases.
"""

from __future__ import annotations

from lm_resiliency.capture.engine import CaptureEngine
from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.detection import Scout, decide_recovery

__all__ = ["CaptureEngine", "InMemoryCheckpointManager", "Scout", "decide_recovery"]

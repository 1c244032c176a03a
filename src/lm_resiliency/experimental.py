"""Low-level pieces without a stability promise (research and custom adapters).

The stable entry points live in :mod:`lm_resiliency`; these may change between
releases. Manager-driven transfers for replacement workflows (:class:`TransferKey`,
:class:`TorchTransfer`, :class:`NixlTransfer`) are described in ``docs/transfers.md``.
"""

from __future__ import annotations

from lm_resiliency.capture.engine import CaptureEngine
from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.detection import Scout, decide_recovery
from lm_resiliency.errors import TransferUnsupported
from lm_resiliency.replication.nixl_transfer import NixlServed, NixlTransfer
from lm_resiliency.replication.torch_transfer import TorchTransfer
from lm_resiliency.replication.transfer import TransferKey

__all__ = [
    "CaptureEngine",
    "InMemoryCheckpointManager",
    "NixlServed",
    "NixlTransfer",
    "Scout",
    "TorchTransfer",
    "TransferKey",
    "TransferUnsupported",
    "decide_recovery",
]

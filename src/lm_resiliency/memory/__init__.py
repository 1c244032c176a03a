"""The memory tier: slot arenas as files on a node-local memory filesystem.

They outlive the training process, so a worker restarted by torchrun (or a
whole job restarted on the same node with the same run id) recovers from
memory instead of disk. See ``docs/memory.md``.
"""

from __future__ import annotations

from lm_resiliency.memory.folder import MemoryFolder, slot_file_name
from lm_resiliency.memory.slotfile import (
    MemoryFolderFull,
    SlotFile,
    SlotIdentity,
    SlotReason,
    SlotRecord,
    SlotUnavailable,
)
from lm_resiliency.memory.tier import MemoryTier

__all__ = [
    "MemoryFolder",
    "MemoryFolderFull",
    "MemoryTier",
    "SlotFile",
    "SlotIdentity",
    "SlotReason",
    "SlotRecord",
    "SlotUnavailable",
    "slot_file_name",
]

"""Recovery modes: which captured steps recovery may choose."""

from __future__ import annotations

import enum


class RecoveryMode(str, enum.Enum):
    """Which steps recovery may choose."""

    LATEST = "latest"
    """The newest step every rank can load (walks back past a step that fails validation)."""

    RECOVERY_VERIFIED = "recovery_verified"
    """The newest step every rank can load that every rank recorded as verified; fails closed."""

"""Trust status of a persisted generation."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TrustStatus(str, enum.Enum):
    """How far a persisted step has been certified (by SCOUT or the caller).

    Stored in each shard at write time; a shard of a peer carries the peer's
    status so recovery can rebuild the verified generation after node loss.
    """

    UNVERIFIED = "unverified"
    """Captured and complete, not (yet) certified."""

    CANDIDATE = "candidate"
    """Captured after one accepted validation cycle; excluded from verified recovery."""

    RECOVERY_VERIFIED = "recovery_verified"
    """Certified: eligible for ``RecoveryMode.RECOVERY_VERIFIED``."""


RECOVERY_VERDICT_MODE = "recovery_verified"


@dataclass(frozen=True)
class RecoveryVerdict:
    """A persisted instruction to recover in ``RECOVERY_VERIFIED`` mode (written by SCOUT).

    Recorded in every rank's sidecar when SCOUT finds silent data corruption, so a
    restarted job chooses the verified generation without being told. ``step`` is
    the boundary at which it was found, ``reason`` says what was found where.
    """

    step: int
    reason: str
    mode: str = RECOVERY_VERDICT_MODE

"""Trust status of a persisted generation."""

from __future__ import annotations

import enum


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

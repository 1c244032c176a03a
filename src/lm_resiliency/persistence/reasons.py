"""Why a shard is unavailable, and the exception that says so.

Every refusal of the loader carries one :class:`UnavailableReason` so callers,
tests and ``lm-resiliency inspect`` can tell a torn write from a foreign file
from a checksum failure without parsing messages.
"""

from __future__ import annotations

import enum
from pathlib import Path

from lm_resiliency.errors import ShardIdentityMismatch, ShardIntegrityError, ShardUnavailable


class UnavailableReason(str, enum.Enum):
    """Stable codes for ``ShardUnavailable.reason``."""

    MISSING = "missing"
    SYMLINK = "symlink"
    NOT_A_FILE = "not_a_file"
    FOREIGN_OWNER = "foreign_owner"
    WRITABLE_BY_OTHERS = "writable_by_others"
    IO_ERROR = "io_error"
    TRUNCATED = "truncated"
    HEADER_TOO_LARGE = "header_too_large"
    HEADER_OUT_OF_BOUNDS = "header_out_of_bounds"
    MALFORMED_HEADER = "malformed_header"
    FOREIGN_FORMAT = "foreign_format"
    LEGACY_FORMAT = "legacy_format"
    UNSUPPORTED_VERSION = "unsupported_version"
    SCHEMA = "schema"
    LAYOUT = "layout"
    TENSOR_TABLE = "tensor_table"
    SIZE_MISMATCH = "size_mismatch"
    IDENTITY_RUN = "identity_run"
    IDENTITY_TOPOLOGY = "identity_topology"
    IDENTITY_OWNER = "identity_owner"
    IDENTITY_STEP = "identity_step"
    CHECKSUM_MISSING = "checksum_missing"
    CHECKSUM_MISMATCH = "checksum_mismatch"


_IDENTITY = {
    UnavailableReason.IDENTITY_RUN,
    UnavailableReason.IDENTITY_TOPOLOGY,
    UnavailableReason.IDENTITY_OWNER,
    UnavailableReason.IDENTITY_STEP,
}
_INTEGRITY = {UnavailableReason.CHECKSUM_MISSING, UnavailableReason.CHECKSUM_MISMATCH}


def unavailable(reason: UnavailableReason, path: str | Path, detail: str) -> ShardUnavailable:
    """The exception for ``reason``: an integrity or identity subclass where one fits.

    The message starts with the path and the reason code, then ``detail``
    (which should say what was found and what to do).
    """
    message = f"shard {path} is unavailable ({reason.value}): {detail}"
    if reason in _INTEGRITY:
        return ShardIntegrityError(message, reason=reason.value, path=str(path))
    if reason in _IDENTITY:
        return ShardIdentityMismatch(message, reason=reason.value, path=str(path))
    return ShardUnavailable(message, reason=reason.value, path=str(path))

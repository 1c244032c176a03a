"""One exception hierarchy for lm-resiliency.

Every error a user can act on derives from :class:`ResiliencyError`. Errors that
are also classic Python categories (bad argument values, unsupported types)
additionally derive from ``ValueError``/``TypeError`` so generic handlers still
catch them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


class ResiliencyError(Exception):
    """Base class of every error raised by lm-resiliency."""


class ConfigError(ResiliencyError, ValueError):
    """A configuration value is invalid; the message names the field and a valid choice."""


class StateEncodingError(ResiliencyError, TypeError):
    """A value in a captured state tree cannot be encoded safely (raised at capture time)."""


class StateSchemaError(ResiliencyError, ValueError):
    """A state document does not match the versioned schema (malformed, too large, unknown)."""


class CaptureError(ResiliencyError):
    """A background capture failed; raised on the caller's next call with the step named."""


class CheckpointFormatError(ResiliencyError):
    """A node-local shard is not a readable format-v3 file (legacy, foreign or damaged)."""


class IntegrityError(CheckpointFormatError):
    """A shard's checksum is missing or does not match its bytes."""


class IdentityMismatch(CheckpointFormatError):
    """A shard or message belongs to another run, topology, owner rank or step."""


class ShardUnavailable(CheckpointFormatError):
    """A node-local shard cannot be used for recovery; nothing from it was returned.

    ``reason`` is a short stable code (``"checksum_mismatch"``, ``"identity_step"``,
    ... see ``lm_resiliency.persistence.UnavailableReason``) and ``path`` the file.
    """

    def __init__(self, message: str, *, reason: str, path: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.path = path


class ShardIntegrityError(ShardUnavailable, IntegrityError):
    """A shard is unavailable because its checksum is missing or does not match."""


class ShardIdentityMismatch(ShardUnavailable, IdentityMismatch):
    """A shard is unavailable because it names another run, topology, owner or step."""


class UnsafePathError(ResiliencyError):
    """A path inside the checkpoint folder is unsafe to use: never followed, read or replaced.

    ``reason`` is a short stable code: ``"symlink"``, ``"not_a_directory"``,
    ``"not_a_file"`` (a FIFO, socket, device...), ``"foreign_owner"``,
    ``"writable_by_others"``, ``"hard_linked"`` or ``"replaced"``; ``path`` the
    entry. The message names the path, its owner and mode, and the fix.
    """

    def __init__(self, message: str, *, reason: str = "unsafe", path: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.path = path


class SidecarUnavailable(CheckpointFormatError):
    """A rank's status sidecar is malformed or names another identity (fails closed).

    ``reason`` is a short stable code (``"malformed"``, ``"identity"``, ``"schema"``,
    ``"trust"``, or an :class:`UnsafePathError` reason such as ``"not_a_file"``);
    callers treat the rank's status as unknown, never as empty.
    """

    def __init__(self, message: str, *, reason: str, path: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.path = path


class NoConsistentStep(ResiliencyError):
    """No step is available on every rank (and no fallback was given)."""


class ReplicationError(ResiliencyError):
    """A peer exchange failed, timed out, or carried a mismatched header."""


class TransferUnsupported(ReplicationError):
    """A transfer backend cannot serve this request (not installed, not host memory, ...).

    Nothing falls back on its own: the message names the backend to choose instead.
    """


class CollectiveTimeout(ResiliencyError):
    """A bounded distributed wait expired; the message names rank, peer and operation."""


class StepAborted(ResiliencyError):
    """An MTGS step could not be committed after all retries; names ranks and reasons.

    ``step`` is the step number and ``reasons`` maps each unhealthy rank to the
    reason names of its last failed attempt (empty when unknown, e.g. a peer died).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        reasons: dict[int, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.reasons = dict(reasons or {})


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure: the exception type name, its message and formatted traceback."""

    rank: int
    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank=rank, exc_type=type(exc).__name__, message=str(exc), traceback=tb)


class RankFailures(ResiliencyError):
    """Failures of several ranks gathered into one exception (rank -> failure).

    ``failures`` maps each failed rank to its :class:`RankFailure`; the message
    lists every rank with its error and traceback so one glance at a test log
    shows which rank failed and where.
    """

    def __init__(self, summary: str, failures: dict[int, RankFailure]) -> None:
        self.summary = summary
        self.failures = dict(sorted(failures.items()))
        parts = [f"{summary}: {len(self.failures)} rank(s) failed"]
        for rank, f in self.failures.items():
            parts.append(f"--- rank {rank}: {f.exc_type}: {f.message}\n{f.traceback.rstrip()}")
        super().__init__("\n".join(parts))

    @property
    def ranks(self) -> list[int]:
        return list(self.failures)

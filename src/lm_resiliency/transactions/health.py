"""Local health checks of one rank: exception classes, non-finite values.

Checks that must agree across ranks travel in the vote; these functions only
classify what this rank saw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lm_resiliency.transactions.reasons import AbortReason

# Gloo and NCCL report a lost or silent peer as a plain RuntimeError; these
# fragments of their messages identify it (checked after the typed DistError).
_COMM_MARKERS = (
    "gloo/",
    "NCCL",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",
    "Operation timed out",
    # After one operation timed out, Gloo closes every pair of the group and fails the
    # other pending ones with this text alone (no source path in it).
    "Application timeout caused pair closure",
    "ProcessGroup",
)
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of any device."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` means a collective failed (peer died, hung, or the group broke).

    Such a step cannot be voted on any more: the group itself is unusable, so
    the transaction ends with an error instead of completing collectives.
    """
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MARKERS)


def is_timeout(exc: BaseException) -> bool:
    """Whether a communication error was a timeout rather than a lost connection."""
    return any(m in str(exc) for m in _TIMEOUT_MARKERS)


def exception_code(exc: BaseException, phase: AbortReason) -> int:
    """The abort code for an exception raised in ``phase`` (adds ``OUT_OF_MEMORY`` if so)."""
    code = int(phase)
    if is_out_of_memory(exc):
        code |= AbortReason.OUT_OF_MEMORY
    return code


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (one fused L2-norm pass, one sync).

    The L2 norm propagates NaN and infinity; it also overflows for values above
    ~1e19 in float32, which this check then reports as non-finite (such values
    are a diverged state in any case). The max-abs norm would not overflow but
    is an order of magnitude slower on CPU.
    """
    floats = [t.detach() for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floats:
        return True
    norms = torch._foreach_norm(floats)
    return bool(torch.isfinite(torch.stack([n.to(floats[0].device) for n in norms])).all())

"""Peer replication: pairing, chunk sizing and the chunked Gloo transport.

:func:`resolve_jump` and :class:`PairingPlan` decide who holds whose replica;
:func:`estimate_chunk_size` picks ``replication_chunk_size`` from the training's
communication slack; :class:`ReplicationChannel` moves a header plus an arena
between partners (:func:`make_header` builds the header). See
``docs/replication.md`` for the protocol and the failure model.
"""

from __future__ import annotations

from lm_resiliency.replication._protocol import Received
from lm_resiliency.replication.chunking import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    estimate_chunk_size,
)
from lm_resiliency.replication.header import HEADER_VERSION, check_header, make_header
from lm_resiliency.replication.pairing import AUTO_JUMP, JumpDecision, PairingPlan, resolve_jump
from lm_resiliency.replication.transport import (
    DEFAULT_MAX_HEADER_BYTES,
    ReplicationChannel,
)

__all__ = [
    "AUTO_JUMP",
    "DEFAULT_MAX_HEADER_BYTES",
    "HEADER_VERSION",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "JumpDecision",
    "PairingPlan",
    "Received",
    "ReplicationChannel",
    "check_header",
    "estimate_chunk_size",
    "make_header",
    "resolve_jump",
]

"""Manager-driven transfers: send a named checkpoint from one rank to a partner.

A transfer is bound to a :class:`TransferKey`: a name chosen by the manager
(e.g. ``"gemini/step-20/owner-1"``), the two endpoints, and the tensor metadata
(layout digest and byte count). The sender puts the key and a CRC-32C per
``crc_chunk_bytes`` chunk of the arena into the header; the receiver refuses a
header whose key names other endpoints or another layout *before* accepting any
bytes, and verifies every chunk's checksum after the bytes arrived.

Call order: the two endpoints call :func:`send_checkpoint` and
:func:`recv_checkpoint` with equal keys at the same time (both endpoints are
required; there is no one-sided fallback). Transport and waits are those of the
:class:`~lm_resiliency.replication.ReplicationChannel` (every wait bounded by
its ``timeout_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from lm_resiliency.errors import IntegrityError, ReplicationError
from lm_resiliency.replication._protocol import Received
from lm_resiliency.replication.transport import ReplicationChannel

CRC_CHUNK_BYTES = 16 * 1024 * 1024
"""Checksum granularity: a corrupt chunk is named by its index."""


@dataclass(frozen=True)
class TransferKey:
    """Names one transfer and binds it to its endpoints and tensor metadata."""

    name: str
    src: int
    dst: int
    step: int
    layout_digest: str
    total_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "src": self.src,
            "dst": self.dst,
            "step": self.step,
            "layout_digest": self.layout_digest,
            "total_bytes": self.total_bytes,
        }


def chunk_checksums(arena: torch.Tensor, chunk_bytes: int = CRC_CHUNK_BYTES) -> list[int]:
    """CRC-32C of each ``chunk_bytes`` piece of a flat ``uint8`` CPU tensor."""
    view = arena.numpy().data
    return [crc32c.crc32c(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


def send_checkpoint(
    channel: ReplicationChannel,
    key: TransferKey,
    *,
    header: dict[str, Any],
    arena: torch.Tensor,
) -> None:
    """Send ``arena`` (described by ``header``) to ``key.dst`` under ``key``.

    ``header`` comes from :func:`~lm_resiliency.replication.make_header` for
    the owner and step the key names. Raises ``ReplicationError`` when the peer
    refuses, times out or disappears; ``ValueError`` when key and header disagree.
    """
    if key.src != channel.rank:
        raise ValueError(
            f"transfer {key.name!r} is from rank {key.src}, not this rank {channel.rank}"
        )
    if key.layout_digest != header.get("layout_digest") or key.total_bytes != arena.numel():
        raise ValueError(f"transfer {key.name!r}: key does not describe the arena being sent")
    full = {
        **header,
        "transfer": key.to_json(),
        "crc_chunk_bytes": CRC_CHUNK_BYTES,
        "chunk_crc32c": chunk_checksums(arena),
    }
    channel.send(key.dst, step=key.step, header=full, arena=arena)


def recv_checkpoint(channel: ReplicationChannel, key: TransferKey, *, owner_rank: int) -> Received:
    """Receive the checkpoint named by ``key`` from ``key.src`` into a fresh arena.

    Refuses (before any bytes) a header whose transfer key differs from ``key``;
    after the bytes arrived, verifies every chunk's CRC-32C. Raises
    ``ReplicationError`` (transport or key mismatch) or ``IntegrityError``
    (a chunk's checksum failed; its index is named).
    """
    if key.dst != channel.rank:
        raise ValueError(
            f"transfer {key.name!r} is to rank {key.dst}, not this rank {channel.rank}"
        )

    def validate(header: dict[str, Any]) -> None:
        got = header.get("transfer")
        if got != key.to_json():
            raise ReplicationError(f"transfer key mismatch: expected {key.to_json()}, got {got}")
        crcs = header.get("chunk_crc32c")
        size = header.get("crc_chunk_bytes")
        if not isinstance(size, int) or size <= 0 or not isinstance(crcs, list):
            raise ReplicationError(f"transfer {key.name!r} carries no per-chunk checksums")
        if len(crcs) != -(-key.total_bytes // size):
            raise ReplicationError(f"transfer {key.name!r}: {len(crcs)} checksums for its size")

    received = channel.recv(
        key.src,
        step=key.step,
        expect_owner=owner_rank,
        recv_alloc=lambda h: torch.empty(int(h["total_bytes"]), dtype=torch.uint8),
        validate=validate,
    )
    expected = received.header["chunk_crc32c"]
    size = received.header["crc_chunk_bytes"]
    actual = chunk_checksums(received.arena, size)
    bad = [i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b]
    if bad:
        raise IntegrityError(
            f"transfer {key.name!r} from rank {key.src}: chunk(s) {bad} of {len(actual)} "
            f"failed their CRC-32C check; the received state was discarded"
        )
    return received

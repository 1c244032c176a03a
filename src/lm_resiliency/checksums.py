"""CRC-32C per fixed-size chunk of a byte stream that arrives in pieces.

Transfers and shard reads see their bytes in pieces whose boundaries need not
match the checksum granularity (a transport chunk of 21 MB against 16 MiB CRC
chunks, say). :class:`ChunkCrc` is fed the pieces in order and yields one
CRC-32C per ``chunk_bytes`` of the stream, the same values
``crc32c(data[i : i + chunk_bytes])`` would give, so a checksum can be computed
while the bytes move instead of in a second pass after they arrived.

On the wire a list of checksums travels as little-endian ``uint32`` values
(:func:`pack_crcs` / :func:`unpack_crcs`).
"""

from __future__ import annotations

import struct
from typing import Any

import crc32c
import torch

from lm_resiliency.knobs import CRC_CHUNK_BYTES


def crc_count(total_bytes: int, chunk_bytes: int) -> int:
    """How many checksums cover ``total_bytes`` in ``chunk_bytes`` chunks."""
    return -(-total_bytes // chunk_bytes)


class ChunkCrc:
    """Running CRC-32C of consecutive ``chunk_bytes`` chunks of a ``total_bytes`` stream."""

    def __init__(self, chunk_bytes: int, total_bytes: int) -> None:
        if chunk_bytes <= 0 or total_bytes < 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be > 0, total_bytes >= 0")
        self.chunk_bytes = chunk_bytes
        self.total_bytes = total_bytes
        self._done: list[int] = []
        self._current = 0
        self._filled = 0
        self._fed = 0

    @property
    def fed_bytes(self) -> int:
        return self._fed

    def update(self, data: Any) -> None:
        """Feed the next piece of the stream (any buffer: bytes, memoryview, array)."""
        view = memoryview(data).cast("B")
        if self._fed + len(view) > self.total_bytes:
            raise ValueError(
                f"fed {self._fed + len(view)} bytes into a checksum of {self.total_bytes} bytes"
            )
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, self.chunk_bytes - self._filled)
            self._current = crc32c.crc32c(view[pos : pos + take], self._current)
            self._filled += take
            pos += take
            if self._filled == self.chunk_bytes:
                self._done.append(self._current)
                self._current = 0
                self._filled = 0
        self._fed += len(view)

    def digests(self) -> list[int]:
        """One CRC-32C per chunk; every byte of the stream must have been fed."""
        if self._fed != self.total_bytes:
            raise ValueError(f"checksum fed {self._fed} of {self.total_bytes} bytes")
        return self._done + ([self._current] if self._filled else [])


def arena_crcs(arena: torch.Tensor, chunk_bytes: int = CRC_CHUNK_BYTES) -> tuple[int, ...]:
    """CRC-32C of every ``chunk_bytes`` chunk of a flat ``uint8`` CPU tensor (one pass)."""
    view = memoryview(arena.numpy())  # type: ignore[arg-type]
    n = len(view)
    return tuple(crc32c.crc32c(view[o : o + chunk_bytes]) for o in range(0, n, chunk_bytes))


def pack_crcs(crcs: list[int]) -> bytes:
    """Checksums as little-endian ``uint32`` bytes."""
    return struct.pack(f"<{len(crcs)}I", *crcs)


def unpack_crcs(blob: bytes) -> list[int]:
    """Inverse of :func:`pack_crcs`; raises ``ValueError`` on a ragged blob."""
    if len(blob) % 4:
        raise ValueError(f"{len(blob)} checksum bytes are not a whole number of uint32 values")
    return list(struct.unpack(f"<{len(blob) // 4}I", blob))


def mismatched(actual: list[int], expected: list[int]) -> list[int]:
    """Indices of the chunks whose checksums differ (lengths must match)."""
    return [i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b]

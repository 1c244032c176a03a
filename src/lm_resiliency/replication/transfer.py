"""Keyed transfers: send a named checkpoint from one rank to another.

A transfer is bound to a :class:`TransferKey`: a name chosen by the manager
(e.g. ``"gemini/step-20/owner-1"``), the two endpoints (source and destination
rank), the step, and the tensor metadata (layout digest and byte count). The
sender puts the key into the header and a CRC-32C per ``crc_chunk_bytes`` chunk
into the trailer that follows the bytes; the receiver refuses a header whose key
names other endpoints or another layout *before* accepting any bytes, and checks
every chunk against the trailer.

Checksums are computed while the bytes move, never in a pass of their own: the
sender checksums each chunk just before posting it (while earlier chunks are in
flight), the receiver each chunk as it completes. A source that already knows
its checksums (a shard file, which stores one CRC per chunk) sends those
instead, so a corrupt file is caught end to end by the receiver, and its bytes
are read and sent chunk by chunk (:class:`ArenaReader`), never staged whole.

Call order: the two endpoints call :func:`send_checkpoint` and
:func:`recv_checkpoint` with equal keys at the same time (both endpoints are
required; there is no one-sided fallback). Transport and waits are those of the
channel: a :class:`~lm_resiliency.replication.ReplicationChannel` between
replication partners (recovery), or the two-rank edge that
:class:`~lm_resiliency.replication.torch_transfer.TorchTransfer` builds between
any two ranks (manager-driven replacement); every wait is bounded by its
``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lm_resiliency.capture.arena import allocate_arena
from lm_resiliency.capture.target import Target
from lm_resiliency.checksums import ChunkCrc, crc_count, mismatched, pack_crcs, unpack_crcs
from lm_resiliency.errors import IntegrityError, ReplicationError
from lm_resiliency.knobs import CRC_CHUNK_BYTES, READ_AHEAD_CHUNKS
from lm_resiliency.replication._link import Allocator, ChunkSink, ChunkSource, Validator
from lm_resiliency.replication._protocol import Received


class TransferChannel(Protocol):
    """What a keyed transfer runs on: one-direction sends and receives between two ranks.

    :class:`~lm_resiliency.replication.ReplicationChannel` is one (between partners).
    """

    rank: int

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def max_in_flight(self) -> int: ...

    def send(
        self,
        peer: int,
        *,
        step: int,
        header: dict[str, Any],
        arena: torch.Tensor | None = None,
        source: ChunkSource | None = None,
        trailer: Callable[[], bytes] | None = None,
    ) -> None: ...

    def recv(
        self,
        peer: int,
        *,
        step: int,
        expect_owner: int,
        recv_alloc: Allocator,
        validate: Validator | None = None,
        sink: ChunkSink | None = None,
    ) -> Received: ...


class ArenaReader(Protocol):
    """Bytes of an arena that are read on demand (e.g. from a shard file)."""

    @property
    def total_bytes(self) -> int: ...

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (flat uint8) with the bytes at ``offset``; raise if they cannot be read."""

    def checksums(self) -> tuple[int, list[int]] | None:
        """``(chunk_bytes, crcs)`` recorded when the bytes were written, if any."""


@dataclass(frozen=True)
class TransferKey:
    """Names one transfer and binds it to its endpoints, step and tensor metadata.

    ``name`` is the manager's handle for the request (unique per request, e.g.
    ``"replace-rank-3/attempt-1"``); ``src`` and ``dst`` are the job ranks that
    send and receive; ``step`` is the checkpoint's step; ``layout_digest`` and
    ``total_bytes`` describe the arena (:class:`~lm_resiliency.capture.layout.Layout`).
    Both endpoints must be given equal keys: a receiver refuses a transfer whose
    key differs in any field before any arena byte is accepted. Raises
    ``ValueError`` naming the field for a malformed key.
    """

    name: str
    src: int
    dst: int
    step: int
    layout_digest: str
    total_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TransferKey name={self.name!r} must be a non-empty string")
        for field in ("src", "dst", "step", "total_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TransferKey {field}={value!r} must be an integer >= 0")
        if self.src == self.dst:
            raise ValueError(
                f"TransferKey {self.name!r}: src and dst are both rank {self.src}; "
                "a transfer needs two different ranks"
            )
        if not isinstance(self.layout_digest, str) or not self.layout_digest:
            raise ValueError(
                f"TransferKey layout_digest={self.layout_digest!r} must be the layout's digest"
            )

    @property
    def describe(self) -> str:
        """``"'name' (rank src -> rank dst, step N)"`` for messages."""
        return f"{self.name!r} (rank {self.src} -> rank {self.dst}, step {self.step})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "src": self.src,
            "dst": self.dst,
            "step": self.step,
            "layout_digest": self.layout_digest,
            "total_bytes": self.total_bytes,
        }


def check_endpoint(rank: int, key: TransferKey, expected: int, verb: str, other: str) -> None:
    """Raise unless ``key`` is a :class:`TransferKey` and this ``rank`` is its ``expected`` end."""
    if not isinstance(key, TransferKey):
        raise TypeError(f"key must be a TransferKey, got {type(key).__name__}")
    if rank != expected:
        raise ValueError(
            f"transfer {key.describe}: {verb}() runs on rank {expected}, not on this rank "
            f"{rank}; call {other}() here if this rank is the other endpoint"
        )


def send_checkpoint(
    channel: TransferChannel,
    key: TransferKey,
    *,
    header: dict[str, Any],
    arena: torch.Tensor | None = None,
    reader: ArenaReader | None = None,
    slot_crcs: tuple[int, ...] | None = None,
    crc_chunk_bytes: int = CRC_CHUNK_BYTES,
) -> None:
    """Send a checkpoint (described by ``header``) to ``key.dst`` under ``key``.

    ``slot_crcs`` (with ``arena``): the arena's checksums per ``knobs.CRC_CHUNK_BYTES``
    as recorded when it was filled (a memory slot's); they are sent instead of
    checksums of the bytes as they are now, so damage since then is caught by
    the receiver. Without recorded checksums, one CRC-32C per ``crc_chunk_bytes``
    is computed as the bytes go out.

    The bytes come from ``arena`` or from ``reader`` (read on a helper thread
    ``knobs.READ_AHEAD_CHUNKS`` chunks ahead of the transport, into a ring of
    ``channel.max_in_flight + READ_AHEAD_CHUNKS`` chunk buffers).
    ``header`` comes from :func:`~lm_resiliency.replication.make_header` for
    the owner and step the key names. Raises ``ReplicationError`` when the peer
    refuses, times out or disappears; ``ValueError`` when key and header disagree.
    """
    if key.src != channel.rank:
        raise ValueError(
            f"transfer {key.name!r} is from rank {key.src}, not this rank {channel.rank}"
        )
    if (arena is None) == (reader is None):
        raise ValueError("pass exactly one of arena= and reader=")
    total = arena.numel() if arena is not None else reader.total_bytes  # type: ignore[union-attr]
    if key.layout_digest != header.get("layout_digest") or key.total_bytes != total:
        raise ValueError(f"transfer {key.name!r}: key does not describe the arena being sent")
    known = reader.checksums() if reader is not None else None
    if slot_crcs is not None and arena is not None:
        known = (CRC_CHUNK_BYTES, list(slot_crcs))
    crc_chunk, crcs = known if known is not None else (crc_chunk_bytes, None)
    running = ChunkCrc(crc_chunk, total) if crcs is None else None
    read_piece = _ReadAhead(reader, channel, total) if reader is not None else None

    def source(offset: int, nbytes: int) -> torch.Tensor:
        if read_piece is not None:
            piece = read_piece(offset, nbytes)
        else:
            assert arena is not None
            piece = arena[offset : offset + nbytes]
        if running is not None:
            running.update(piece.numpy())
        return piece

    def trailer() -> bytes:
        return pack_crcs(crcs if crcs is not None else running.digests())  # type: ignore[union-attr]

    full = {
        **header,
        "transfer": key.to_json(),
        "crc_chunk_bytes": crc_chunk,
        "trailer_bytes": 4 * crc_count(total, crc_chunk),
    }
    try:
        channel.send(
            key.dst,
            step=key.step,
            header=full,
            source=source,
            trailer=trailer if full["trailer_bytes"] else None,
        )
    finally:
        if read_piece is not None:
            read_piece.close()


class _ReadAhead:
    """A :data:`ChunkSource` reading ``reader`` on a helper thread, ahead of the sends.

    Buffers form a ring of ``max_in_flight + READ_AHEAD_CHUNKS``; the transport
    asks for chunk ``c`` only once fewer than ``max_in_flight`` sends are
    unfinished, so the buffer that chunk ``c + READ_AHEAD_CHUNKS`` reuses held a
    chunk whose send has completed. Reading and sending thus overlap, and the
    disk keeps working while the network does.
    """

    def __init__(self, reader: ArenaReader, channel: TransferChannel, total: int) -> None:
        self._reader = reader
        self._chunk = channel.chunk_bytes
        self._total = total
        self._count = crc_count(total, self._chunk)
        size = min(self._chunk, total)
        ring = min(channel.max_in_flight + READ_AHEAD_CHUNKS, self._count)
        # With a buffer per chunk nothing is ever reused: read everything ahead.
        self._lead = self._count if ring == self._count else READ_AHEAD_CHUNKS
        # Each buffer is mapped by the helper thread just before its first read, so the
        # first chunk goes out after one buffer's pages, not the whole ring's.
        self._size = size
        self._ring: list[torch.Tensor | None] = [None] * ring
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmr-read-ahead")
        self._reads: dict[int, Future[None]] = {}
        self._submitted = 0

    def _buffer(self, index: int) -> torch.Tensor:
        offset = index * self._chunk
        slot = index % len(self._ring)
        buffer = self._ring[slot]
        if buffer is None:
            buffer = self._ring[slot] = allocate_arena(self._size, pin=False)
        return buffer[: min(self._chunk, self._total - offset)]

    def _read(self, index: int) -> None:
        self._reader.read_into(index * self._chunk, self._buffer(index))

    def __call__(self, offset: int, nbytes: int) -> torch.Tensor:
        index = offset // self._chunk
        if offset != index * self._chunk or nbytes != min(self._chunk, self._total - offset):
            raise ValueError(f"unexpected chunk [{offset}, +{nbytes}) of {self._chunk}-byte chunks")
        while self._submitted < min(index + self._lead + 1, self._count):
            j = self._submitted
            self._reads[j] = self._pool.submit(self._read, j)
            self._submitted += 1
        self._reads.pop(index).result()  # a failed read raises here, in the sending thread
        return self._buffer(index)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def recv_checkpoint(
    channel: TransferChannel,
    key: TransferKey,
    *,
    owner_rank: int,
    on_chunk: Callable[[int], None] | None = None,
    into: Target | torch.Tensor | None = None,
) -> Received:
    """Receive the checkpoint named by ``key`` from ``key.src`` into a fresh arena.

    ``on_chunk(nbytes)``, if given, is called after each chunk arrived and was
    checksummed, with the bytes received so far (progress, and a test's kill point).
    ``into``: live tensors (a :class:`Target`) to receive into instead, used when their
    layout is the key's (``Received.target`` then says so; otherwise a fresh arena is
    filled); or a flat uint8 CPU tensor of at least ``key.total_bytes`` (e.g. one whose
    pages are already mapped) to receive into instead of a fresh one.

    Refuses (before any bytes) a header whose transfer key differs from ``key``;
    checksums every chunk as it arrives and compares with the sender's trailer.
    Raises ``ReplicationError`` (transport or key mismatch) or ``IntegrityError``
    (a chunk's checksum failed; its index is named; the bytes received into
    ``into`` are then garbage).
    """
    if key.dst != channel.rank:
        raise ValueError(
            f"transfer {key.name!r} is to rank {key.dst}, not this rank {channel.rank}"
        )
    running: list[ChunkCrc] = []
    flat = into if isinstance(into, torch.Tensor) else None
    target = into if isinstance(into, Target) and into.layout.digest == key.layout_digest else None

    def validate(header: dict[str, Any]) -> None:
        got = header.get("transfer")
        if got != key.to_json():
            raise ReplicationError(
                f"transfer key mismatch: rank {channel.rank} expected {key.to_json()}, "
                f"peer {key.src} sent {got}; give both endpoints the same TransferKey"
            )
        size = header.get("crc_chunk_bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ReplicationError(f"transfer {key.name!r} carries no per-chunk checksums")
        if header.get("trailer_bytes") != 4 * crc_count(key.total_bytes, size):
            raise ReplicationError(
                f"transfer {key.name!r}: a trailer of {header.get('trailer_bytes')!r} bytes "
                f"cannot hold one checksum per {size}-byte chunk"
            )
        running.append(ChunkCrc(size, key.total_bytes))

    got = [0]

    def sink(view: torch.Tensor) -> None:
        running[0].update(view.numpy())
        if on_chunk is not None:
            got[0] += view.numel()
            on_chunk(got[0])

    received = channel.recv(
        key.src,
        step=key.step,
        expect_owner=owner_rank,
        recv_alloc=lambda h: (
            target
            if target is not None
            else flat[: int(h["total_bytes"])]
            if flat is not None
            else torch.empty(int(h["total_bytes"]), dtype=torch.uint8)
        ),
        validate=validate,
        sink=sink,
    )
    actual = running[0].digests()
    bad = mismatched(actual, unpack_crcs(received.trailer))
    if bad:
        raise IntegrityError(
            f"transfer {key.name!r} from rank {key.src}: chunk(s) {bad} of {len(actual)} "
            f"failed their CRC-32C check; the received state was discarded"
        )
    return received

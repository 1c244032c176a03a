"""TorchTransfer: a manager-driven transfer between any two ranks over its own Gloo group.

Replacement workflows need transfers that replication partners alone cannot
serve: an external manager tells rank X, which holds rank Y's replica (or an
identical shard of its own), to send it to Y's replacement. Each transfer runs
on a dedicated two-rank Gloo group between exactly those two ranks, built as a
``ProcessGroupGloo`` on a ``PrefixStore`` of the job's store: no collective
over the job, nothing registered in ``torch.distributed``'s group table, and
the other ranks keep training.

Call order (the manager sends the same :class:`TransferKey` to both ranks)::

    # on both endpoints, once (no communication)
    transfer = TorchTransfer(run_id=run_id, timeout_s=30)
    # on rank key.src (the server), at the same time as ...
    transfer.send(key, layout=layout, state_document=doc, arena=arena)
    # ... on rank key.dst (the replacement)
    received = transfer.recv(key)

Both endpoints are required (the sender streams, the receiver acknowledges);
for one-sided reads from registered host memory use
:class:`~lm_resiliency.replication.nixl_transfer.NixlTransfer`, chosen
explicitly by the caller.

The edge rendezvous is keyed by ``(run_id, key.name, key.step, key.src,
key.dst)``, so a new request needs a new ``name`` (a retry after a failure
too); any other difference between the two endpoints' keys (layout, size) is
refused from the header before any arena byte moves. The wire, the per-chunk
CRC-32C and the bounded waits are those of
:mod:`lm_resiliency.replication.transfer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from lm_resiliency.capture.layout import Layout
from lm_resiliency.errors import ConfigError
from lm_resiliency.knobs import MAX_IN_FLIGHT_CHUNKS, REPLICATION_CHUNK_BYTES, REPLICATION_TIMEOUT_S
from lm_resiliency.replication._edge import Edge
from lm_resiliency.replication._link import (
    Allocator,
    ChunkSink,
    ChunkSource,
    TransferLimits,
    Validator,
)
from lm_resiliency.replication._protocol import Outgoing, Received, accept, offer
from lm_resiliency.replication.header import encode_header, make_header
from lm_resiliency.replication.transfer import (
    ArenaReader,
    TransferKey,
    check_endpoint,
    recv_checkpoint,
    send_checkpoint,
)
from lm_resiliency.replication.transport import DEFAULT_MAX_HEADER_BYTES


class TorchTransfer:
    """Keyed, checksummed transfers between any two ranks of the job (torch-distributed).

    Create one per rank that may serve or receive (no communication; the job's
    ``torch.distributed`` store, or ``store=``). Arguments: ``chunk_bytes`` is the
    largest message and the CRC-32C granularity when no recorded checksums are
    sent; ``max_in_flight`` chunks are outstanding; ``timeout_s`` bounds every
    wait (the peer's arrival, each frame, each chunk, the ack; reporting the
    connect to the peer waits at most ``2 * timeout_s``). A timeout raises
    :class:`~lm_resiliency.errors.ReplicationError` naming this rank, the peer,
    the step and the operation.
    """

    def __init__(
        self,
        *,
        run_id: str,
        rank: int | None = None,
        store: Store | None = None,
        chunk_bytes: int = REPLICATION_CHUNK_BYTES,
        timeout_s: float = REPLICATION_TIMEOUT_S,
        max_in_flight: int = MAX_IN_FLIGHT_CHUNKS,
        namespace: str = "lm_resiliency/transfer",
    ) -> None:
        for name, value in (("chunk_bytes", chunk_bytes), ("max_in_flight", max_in_flight)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"TorchTransfer {name}={value!r} must be a positive integer")
        if not timeout_s > 0:
            raise ConfigError(f"TorchTransfer timeout_s={timeout_s!r} must be > 0")
        if not isinstance(run_id, str) or not run_id:
            raise ConfigError(f"TorchTransfer run_id={run_id!r} must be a non-empty string")
        if rank is None or store is None:
            if not dist.is_initialized():
                raise ConfigError(
                    "TorchTransfer needs rank= and store= when torch.distributed is not initialized"
                )
            rank = dist.get_rank() if rank is None else rank
            # See ReplicationChannel: the store the job's default group rendezvoused on.
            store = dist.distributed_c10d._get_default_store() if store is None else store
        self.rank = rank
        self.run_id = run_id
        self.timeout_s = float(timeout_s)
        self._store = store
        self._namespace = namespace
        self._limits = TransferLimits(chunk_bytes, max_in_flight, DEFAULT_MAX_HEADER_BYTES)

    def send(
        self,
        key: TransferKey,
        *,
        layout: Layout,
        state_document: dict[str, Any],
        arena: torch.Tensor | None = None,
        reader: ArenaReader | None = None,
        slot_crcs: tuple[int, ...] | None = None,
    ) -> None:
        """Send the state for ``key.dst``; on ``key.src``, while ``key.dst`` calls :meth:`recv`.

        The bytes come from ``arena`` (flat uint8 CPU tensor) or ``reader`` (e.g. a
        shard file, read chunk by chunk); ``slot_crcs`` are the arena's checksums
        as recorded when it was filled (a memory slot's), so damage since then is
        caught by the receiver. The header names ``key.dst`` as the owner: whether
        the bytes are ``key.dst``'s replica or this rank's own identical shard,
        they are served as ``key.dst``'s state. Returns once the receiver
        acknowledged every byte; raises ``ReplicationError`` otherwise.
        """
        check_endpoint(self.rank, key, key.src, "send", "recv")
        if arena is not None and (
            arena.dtype != torch.uint8
            or arena.dim() != 1
            or arena.device.type != "cpu"
            or not arena.is_contiguous()
        ):
            raise ValueError(
                f"transfer {key.describe}: arena must be a contiguous flat uint8 CPU tensor, "
                f"got {arena.dtype} {tuple(arena.shape)} on {arena.device}"
            )
        header = make_header(self.run_id, key.dst, key.step, layout, state_document)
        with self._pair(key) as pair:
            send_checkpoint(
                pair,
                key,
                header=header,
                arena=arena,
                reader=reader,
                slot_crcs=slot_crcs,
                crc_chunk_bytes=self._limits.chunk_bytes,
            )

    def recv(
        self,
        key: TransferKey,
        *,
        on_chunk: Callable[[int], None] | None = None,
        into: torch.Tensor | None = None,
    ) -> Received:
        """Receive the state ``key`` names (on rank ``key.dst``, while ``key.src`` sends).

        Refuses a transfer whose key differs from ``key`` before any byte; checks
        every chunk's CRC-32C. Returns the arena with its header and layout.
        Raises ``ReplicationError`` (transport, timeout, key mismatch) or
        ``IntegrityError`` (a chunk failed its checksum; its index is named).
        ``on_chunk(nbytes)`` is called after each chunk with the bytes received so far;
        ``into`` (a flat uint8 CPU tensor of at least ``key.total_bytes``) is received
        into instead of a fresh arena.
        """
        check_endpoint(self.rank, key, key.dst, "recv", "send")
        with self._pair(key) as pair:
            return recv_checkpoint(pair, key, owner_rank=key.dst, on_chunk=on_chunk, into=into)

    def _pair(self, key: TransferKey) -> _Pair:
        prefix = f"{self._namespace}/{self.run_id}/{key.name}/step-{key.step}"
        edge = Edge(
            owner=key.src,
            holder=key.dst,
            rank=self.rank,
            store=self._store,
            prefix=prefix,
            timeout_s=self.timeout_s,
        )
        return _Pair(edge, self.run_id, self._limits)


class _Pair:
    """One transfer's two-rank edge, shaped as a :class:`~.transfer.TransferChannel`.

    The edge starts broken, so the transfer's first message connects it through
    the store agreement of :mod:`._rebuild` (the peer's arrival is bounded); it is
    released when the transfer ends.
    """

    def __init__(self, edge: Edge, run_id: str, limits: TransferLimits) -> None:
        self._edge = edge
        self._run_id = run_id
        self._limits = limits
        self.rank = edge.rank

    @property
    def chunk_bytes(self) -> int:
        return self._limits.chunk_bytes

    @property
    def max_in_flight(self) -> int:
        return self._limits.max_in_flight

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self._edge.close()

    def send(
        self,
        peer: int,
        *,
        step: int,
        header: dict[str, Any],
        arena: torch.Tensor | None = None,
        source: ChunkSource | None = None,
        trailer: Callable[[], bytes] | None = None,
    ) -> None:
        assert peer == self._edge.peer
        trailer_bytes = int(header.get("trailer_bytes", 0))
        out = Outgoing(int(header["total_bytes"]), arena, source, trailer_bytes, trailer)
        offer(self._edge, step, encode_header(header), out, self._limits)

    def recv(
        self,
        peer: int,
        *,
        step: int,
        expect_owner: int,
        recv_alloc: Allocator,
        validate: Validator | None = None,
        sink: ChunkSink | None = None,
    ) -> Received:
        assert peer == self._edge.peer
        return accept(
            self._edge,
            step,
            owner_rank=expect_owner,
            run_id=self._run_id,
            recv_alloc=recv_alloc,
            validate=validate,
            limits=self._limits,
            sink=sink,
        )

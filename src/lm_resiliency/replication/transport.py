"""ReplicationChannel: move arenas between paired ranks over private Gloo edges.

Call order (every rank that has a peer, in the same order on every rank)::

    plan = PairingPlan.build(world_size, resolve_jump(jump, world_size).jump)
    channel = ReplicationChannel(plan, run_id=run_id, chunk_bytes=..., timeout_s=...)
    received = channel.exchange(step=step, send_header=..., send_arena=..., recv_alloc=...)
    ...
    channel.close()

Construction connects two directed edges per rank, ``rank -> send_to(rank)``
and ``recv_from(rank) -> rank``, each a private two-rank Gloo group (see
:mod:`lm_resiliency.replication._edge` for why not one shared group). It involves
only a rank and its two partners, never the whole job, and needs the job's
``torch.distributed`` store (or an explicit ``store``).

Both directions of :meth:`ReplicationChannel.exchange` run at the same time
(the receive side on a helper thread). Every wait is bounded by ``timeout_s``,
an edge rebuild's wait for the peer to arrive included. After a
failure the edge involved is rebuilt by both endpoints at the start of their
next transfer, once they agreed in the store to meet (see
:mod:`lm_resiliency.replication._rebuild`); the failed cycle's replica is lost,
later cycles work again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from lm_resiliency.errors import ConfigError, ReplicationError
from lm_resiliency.knobs import (
    MAX_IN_FLIGHT_CHUNKS,
    REPLICATION_CHUNK_BYTES,
    REPLICATION_TIMEOUT_S,
)
from lm_resiliency.replication._edge import Edge
from lm_resiliency.replication._link import (
    Allocator,
    ChunkSink,
    ChunkSource,
    Progress,
    TransferLimits,
    Validator,
)
from lm_resiliency.replication._protocol import Outgoing, Received, accept, offer
from lm_resiliency.replication.header import encode_header
from lm_resiliency.replication.pairing import PairingPlan

DEFAULT_MAX_HEADER_BYTES = 64 * 1024 * 1024
"""Largest JSON header a receiver accepts (layout tables of very large models fit)."""

_instances = itertools.count()


class ReplicationChannel:
    """Transfers of arenas between this rank and its replication partners.

    Create it on every rank whose plan has a peer, in the same order relative to
    other channels on every rank (the instance number is part of the rendezvous
    key). The constructor returns once both edges are connected and raises
    :class:`~lm_resiliency.errors.ReplicationError` naming the peer when a partner
    does not show up within ``timeout_s``.

    Arguments: ``chunk_bytes`` is the largest message (``replication_chunk_size``);
    ``max_in_flight`` chunks are outstanding per direction; ``timeout_s`` bounds
    every single wait (connect, a rebuild's wait for the peer, header, each chunk,
    ack), not a whole transfer;
    ``progress(direction, done_bytes, total_bytes)`` is called after each chunk
    from the thread running that direction.

    One transfer at a time per edge: :meth:`exchange` uses both edges, :meth:`send`
    and :meth:`recv` one each, so a ``send`` to ``recv_from`` and a ``recv`` from
    ``send_to`` may run at once on two threads; an overlap on one edge raises
    ``RuntimeError``.
    """

    def __init__(
        self,
        plan: PairingPlan,
        *,
        run_id: str,
        rank: int | None = None,
        chunk_bytes: int = REPLICATION_CHUNK_BYTES,
        timeout_s: float = REPLICATION_TIMEOUT_S,
        max_in_flight: int = MAX_IN_FLIGHT_CHUNKS,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        store: Store | None = None,
        namespace: str = "lm_resiliency/replication",
        progress: Progress | None = None,
    ) -> None:
        if not plan.has_peer:
            raise ConfigError(
                f"{plan.describe()}: nothing to replicate; do not create a ReplicationChannel"
            )
        _positive_int("chunk_bytes", chunk_bytes)
        _positive_int("max_in_flight", max_in_flight)
        _positive_int("max_header_bytes", max_header_bytes)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be > 0")
        if not isinstance(run_id, str) or not run_id:
            raise ConfigError(f"run_id={run_id!r} must be a non-empty string")
        if rank is None:
            if not dist.is_initialized():
                raise ConfigError("pass rank= (torch.distributed is not initialized)")
            rank = dist.get_rank()
        if store is None:
            if not dist.is_initialized():
                raise ConfigError("pass store= (torch.distributed is not initialized)")
            # The store the job's default group rendezvoused on. torchrun's agent keeps one
            # store across restart attempts; lm_resiliency.distributed.init_process_group
            # prefixes it per worker generation, so our keys never meet an earlier attempt's.
            store = dist.distributed_c10d._get_default_store()
        self.plan = plan
        self.rank = rank
        self.run_id = run_id
        self.send_to = plan.send_to(rank)
        self.recv_from = plan.recv_from(rank)
        self._limits = TransferLimits(chunk_bytes, max_in_flight, max_header_bytes, progress)
        self._closed = False
        prefix = f"{namespace}/{next(_instances)}"
        self._out = Edge(
            owner=rank,
            holder=self.send_to,
            rank=rank,
            store=store,
            prefix=prefix,
            timeout_s=float(timeout_s),
        )
        self._in = Edge(
            owner=self.recv_from,
            holder=rank,
            rank=rank,
            store=store,
            prefix=prefix,
            timeout_s=float(timeout_s),
        )
        # Connect in one global order of edges (lowest endpoint pair first) so that
        # no cycle of ranks each waits for the next one's other edge.
        for edge in sorted((self._out, self._in), key=_edge_order):
            edge.connect("init")
        # One transfer at a time per edge; different edges may be used at once (a
        # rank can hand a replica home while receiving its own during recovery).
        self._busy = {id(self._out): threading.Lock(), id(self._in): threading.Lock()}

    @property
    def chunk_bytes(self) -> int:
        return self._limits.chunk_bytes

    @property
    def max_in_flight(self) -> int:
        return self._limits.max_in_flight

    @property
    def broken_edges(self) -> list[str]:
        """Edges (``"owner->holder"``) that the next transfer will rebuild first."""
        return [e.name for e in (self._out, self._in) if e.broken]

    @property
    def rebuilds(self) -> int:
        """How many times an edge of this channel was rebuilt after a failure."""
        return self._out.rebuilds + self._in.rebuilds

    def exchange(
        self,
        *,
        step: int,
        send_header: dict[str, Any] | None,
        send_arena: torch.Tensor | None,
        recv_alloc: Allocator,
        validate: Validator | None = None,
    ) -> Received:
        """Send this rank's arena to ``send_to`` and receive ``recv_from``'s, concurrently.

        Every rank with a peer calls it for the same ``step`` (the replication
        schedule is identical on all ranks). ``send_header`` (from
        :func:`~lm_resiliency.replication.header.make_header`, owner = this rank,
        step = ``step``) and ``send_arena`` (flat uint8 CPU tensor of
        ``total_bytes``) describe what to send; pass ``None`` for both when this
        rank has nothing valid for ``step``: the peer is told at once instead of
        waiting. The incoming header must carry this run, owner ``recv_from`` and
        ``step``; ``validate`` may check more. Then ``recv_alloc(header)`` (called
        on a helper thread) returns the destination arena.

        Returns only when both directions completed: the peer's arena for ``step``
        is in the tensor ``recv_alloc`` returned, and ``send_to`` acknowledged
        receiving all of ours for ``step``. Anything else (either direction
        rejected, skipped, timed out, lost its peer or mismatched) raises
        ``ReplicationError`` naming this rank, the peer, the step and the failed
        operation, after both directions have finished; the destination arena's
        content must then be treated as invalid.
        """
        if (send_header is None) != (send_arena is None):
            raise ValueError("send_header and send_arena must both be given or both be None")
        blob = self._prepare_send(step, send_header, send_arena)
        with self._exclusive(self._out, self._in):
            outcome: dict[str, Any] = {}

            def receive() -> None:
                try:
                    outcome["received"] = accept(
                        self._in,
                        step,
                        owner_rank=self.recv_from,
                        run_id=self.run_id,
                        recv_alloc=recv_alloc,
                        validate=validate,
                        limits=self._limits,
                    )
                except BaseException as exc:  # handed to the caller's thread below
                    outcome["recv_error"] = exc

            thread = threading.Thread(target=receive, name="lmr-replication-recv", daemon=True)
            thread.start()
            send_error: BaseException | None = None
            try:
                out = None if send_arena is None else Outgoing(send_arena.numel(), send_arena)
                offer(self._out, step, blob, out, self._limits)
            except BaseException as exc:
                send_error = exc
            # Every wait inside is bounded by timeout_s, so this join is too.
            thread.join()
        recv_error = outcome.get("recv_error")
        if send_error is None and recv_error is None:
            received: Received = outcome["received"]
            return received
        parts = [str(e) for e in (send_error, recv_error) if e is not None]
        first = send_error if send_error is not None else recv_error
        assert first is not None
        if not isinstance(first, Exception):
            raise first  # KeyboardInterrupt and friends pass through untouched
        raise ReplicationError("replication exchange failed: " + "; ".join(parts)) from first

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
        """Send one arena to ``peer`` (one of this rank's two partners); ``peer`` must
        call :meth:`recv` for this rank and ``step`` at the same time.

        Used to hand a replica back to its owner during recovery (then
        ``header["owner_rank"]`` is the receiving peer). The bytes come from
        ``arena`` or, chunk by chunk, from ``source`` (see
        :data:`~lm_resiliency.replication._link.ChunkSource`; a ring of
        :attr:`max_in_flight` buffers of :attr:`chunk_bytes` suffices). When
        ``header["trailer_bytes"]`` is set, ``trailer()`` is called after the last
        chunk went out and must return exactly that many bytes. Returns once the
        peer acknowledged every byte; raises ``ReplicationError`` otherwise.
        """
        if (arena is None) == (source is None):
            raise ValueError("pass exactly one of arena= and source=")
        blob = self._prepare_send(step, header, arena, owner=header.get("owner_rank"))
        assert blob is not None
        trailer_bytes = header.get("trailer_bytes", 0)
        if bool(trailer_bytes) != (trailer is not None):
            raise ValueError("header['trailer_bytes'] and trailer= must be given together")
        out = Outgoing(int(header["total_bytes"]), arena, source, int(trailer_bytes), trailer)
        edge = self._edge_to(peer, sending=True)
        with self._exclusive(edge):
            offer(edge, step, blob, out, self._limits)

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
        """Receive one arena from ``peer`` (one of this rank's two partners), which
        calls :meth:`send` for this rank and ``step`` at the same time.

        The header must carry this run, ``expect_owner`` (this rank itself when a
        replica comes home) and ``step``. ``sink(view)`` is called with each chunk
        once it arrived, in order. Raises ``ReplicationError`` on any failure; the
        arena's content is then invalid.
        """
        edge = self._edge_to(peer, sending=False)
        with self._exclusive(edge):
            return accept(
                edge,
                step,
                owner_rank=expect_owner,
                run_id=self.run_id,
                recv_alloc=recv_alloc,
                validate=validate,
                limits=self._limits,
                sink=sink,
            )

    def close(self) -> None:
        """Release both edges; the channel cannot be used afterwards."""
        self._out.close()
        self._in.close()
        self._closed = True

    def __enter__(self) -> ReplicationChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _edge_to(self, peer: int, *, sending: bool) -> Edge:
        # Both endpoints must pick the same edge. A transfer against the edge's own
        # direction (holder -> owner) is preferred, so in symmetric pairs a replica
        # going home travels on the edge its owner sent it on.
        if sending:
            order = (self._in, self._out) if peer == self.recv_from else (self._out,)
        else:
            order = (self._out, self._in) if peer == self.send_to else (self._in,)
        for edge in order:
            if edge.peer == peer:
                return edge
        raise ValueError(
            f"rank {self.rank} has no replication edge with rank {peer}; its partners are "
            f"{self.send_to} (holds its replica) and {self.recv_from} (whose replica it holds)"
        )

    def _prepare_send(
        self,
        step: int,
        header: dict[str, Any] | None,
        arena: torch.Tensor | None,
        *,
        owner: object = None,
    ) -> bytes | None:
        if header is None:
            if arena is not None:
                raise ValueError("send_header and send_arena must both be given or both be None")
            return None
        expected_owner = self.rank if owner is None else owner
        if header.get("step") != step or header.get("owner_rank") != expected_owner:
            raise ValueError(
                f"header is for owner {header.get('owner_rank')!r} step {header.get('step')!r}, "
                f"but this transfer is for owner {expected_owner} step {step}"
            )
        if arena is None:
            total = header.get("total_bytes")
            if isinstance(total, bool) or not isinstance(total, int) or total < 0:
                raise ValueError(f"header total_bytes={total!r} is not a byte count")
            return encode_header(header)
        if (
            arena.dtype != torch.uint8
            or arena.dim() != 1
            or arena.device.type != "cpu"
            or not arena.is_contiguous()
            or arena.numel() != header.get("total_bytes")
        ):
            raise ValueError(
                f"arena must be a contiguous flat uint8 CPU tensor of the header's "
                f"{header.get('total_bytes')!r} bytes, got {arena.dtype} {tuple(arena.shape)} "
                f"on {arena.device}"
            )
        return encode_header(header)

    def _exclusive(self, *edges: Edge) -> _Exclusive:
        if self._closed:
            raise ReplicationError(f"rank {self.rank}: replication channel is closed")
        return _Exclusive([self._busy[id(e)] for e in edges])


class _Exclusive:
    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks
        self._held: list[threading.Lock] = []

    def __enter__(self) -> None:
        for lock in self._locks:
            if not lock.acquire(blocking=False):
                self.__exit__()
                raise RuntimeError("ReplicationChannel transfers on one edge must not overlap")
            self._held.append(lock)

    def __exit__(self, *exc: object) -> None:
        while self._held:
            self._held.pop().release()


def _edge_order(edge: Edge) -> tuple[int, int, int]:
    return (min(edge.owner, edge.holder), max(edge.owner, edge.holder), edge.owner)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")

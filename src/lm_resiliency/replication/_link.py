"""One transfer's view of an edge: bounded operations that raise with full context.

Every operation names this rank, the peer, the step and what was being done when
it fails; a transport failure also marks the edge broken so that both endpoints
rebuild it before their next transfer.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.capture.arena import allocate_arena, populate
from lm_resiliency.capture.target import Target
from lm_resiliency.errors import ReplicationError
from lm_resiliency.replication._edge import Edge, describe_failure
from lm_resiliency.replication._wire import Frame, Tag, empty_frame

Progress = Callable[[str, int, int], None]
"""``progress(direction, done_bytes, total_bytes)``; direction is ``"send"`` or ``"recv"``."""

Validator = Callable[[dict[str, Any]], None]
"""Extra header check run after the built-in ones; raise to reject the header."""

Allocator = Callable[[dict[str, Any]], "torch.Tensor | Target"]
"""Returns the destination for a validated header: a flat uint8 CPU tensor, or the live
tensors of a :class:`~lm_resiliency.capture.target.Target` of the header's layout."""

ChunkSource = Callable[[int, int], torch.Tensor]
"""``source(offset, nbytes)``: the bytes ``[offset, offset + nbytes)`` of the arena
being sent, as a flat uint8 CPU tensor that stays untouched until that chunk's send
completed. Called in order, at most ``max_in_flight`` chunks ahead of the oldest
unfinished send (a ring of ``max_in_flight`` buffers can be reused)."""

ChunkSink = Callable[[torch.Tensor], None]
"""``sink(view)``: called in order with each received chunk once it has fully arrived."""


@dataclass(frozen=True)
class TransferLimits:
    """What bounds every transfer of a channel: chunk size, chunks in flight, header size.

    (Plus the channel's progress hook.)
    """

    chunk_bytes: int
    max_in_flight: int
    max_header_bytes: int
    progress: Progress | None = None


class Link:
    """One transfer's bounded operations on an edge, with context for errors."""

    def __init__(self, edge: Edge, step: int, direction: str) -> None:
        self.edge = edge
        self.step = step
        self.direction = direction

    def error(self, operation: str, detail: str) -> ReplicationError:
        if operation.startswith(("send", "receive")):
            prep = "to" if operation.startswith("send") else "from"
        else:
            prep = "to" if self.direction == "send" else "from"
        return ReplicationError(
            f"rank {self.edge.rank}: {operation} {prep} peer {self.edge.peer} for step "
            f"{self.step} failed: {detail}"
        )

    def _transport_error(self, operation: str, exc: RuntimeError) -> ReplicationError:
        self.edge.mark_broken()
        return self.error(
            operation,
            f"{describe_failure(exc)}; edge {self.edge.name} will be rebuilt at the next transfer",
        )

    def send(self, tensor: torch.Tensor, tag: Tag, operation: str) -> Any:
        try:
            return self.edge.post_send(tensor, int(tag))
        except RuntimeError as exc:
            raise self._transport_error(operation, exc) from exc

    def recv(self, tensor: torch.Tensor, tag: Tag, operation: str) -> Any:
        try:
            return self.edge.post_recv(tensor, int(tag))
        except RuntimeError as exc:
            raise self._transport_error(operation, exc) from exc

    def wait(self, work: Any, operation: str) -> None:
        try:
            self.edge.wait(work)
        except RuntimeError as exc:
            raise self._transport_error(operation, exc) from exc

    def frame(self, tag: Tag, operation: str) -> Frame:
        buf = empty_frame()
        self.wait(self.recv(buf, tag, operation), operation)
        try:
            return Frame.unpack(buf)
        except ReplicationError as exc:
            self.edge.mark_broken()
            raise self.error(operation, str(exc)) from None

    def protocol_error(self, operation: str, detail: str) -> ReplicationError:
        self.edge.mark_broken()
        return self.error(operation, f"protocol error: {detail}")


def _chunks(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(o, min(chunk_bytes, total_bytes - o)) for o in range(0, total_bytes, chunk_bytes)]


def stream(
    link: Link,
    arena: torch.Tensor | Target | None,
    total_bytes: int,
    chunk_bytes: int,
    limits: TransferLimits,
    *,
    source: ChunkSource | None = None,
    sink: ChunkSink | None = None,
) -> None:
    """Move ``total_bytes`` in chunks, ``max_in_flight`` outstanding at once.

    Sending reads each chunk from ``source`` when given, else from ``arena``.
    Receiving writes into ``arena``, mapping each chunk's pages just before its
    receive is posted (so page faults overlap the chunks still in flight rather
    than stall the transport thread), and hands each completed chunk to ``sink``.
    A :class:`~lm_resiliency.capture.target.Target` as ``arena`` receives each
    chunk straight into the live tensor holding it; a chunk spanning two tensors
    lands in one of ``max_in_flight`` pre-faulted bounce buffers and is copied
    into place once it arrived (before ``sink`` sees it).
    """
    sending = link.direction == "send"
    post = link.send if sending else link.recv
    verb = "send" if sending else "receive"
    chunks = _chunks(total_bytes, chunk_bytes)
    pending: deque[tuple[Any, int, int, torch.Tensor, bool]] = deque()
    target = arena if isinstance(arena, Target) else None
    ring: dict[int, torch.Tensor] = {}
    done = 0

    def retire() -> None:
        nonlocal done
        work, index, offset, piece, bounced = pending.popleft()
        link.wait(work, f"{verb} chunk {index + 1}/{len(chunks)}")
        done += piece.numel()
        if bounced:
            assert target is not None
            target.write(offset, piece)
        if sink is not None and not sending:
            sink(piece)
        if limits.progress is not None:
            limits.progress(link.direction, done, total_bytes)

    def destination(index: int, offset: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        if target is None:
            assert isinstance(arena, torch.Tensor)
            return arena[offset : offset + nbytes], False
        direct = target.piece(offset, nbytes)
        if direct is not None:
            return direct, False
        # Buffer ``index % max_in_flight`` held chunk ``index - max_in_flight`` at most,
        # retired (copied into place) before this chunk is posted.
        slot = index % limits.max_in_flight
        if slot not in ring:
            ring[slot] = allocate_arena(min(chunk_bytes, total_bytes), pin=False)
        return ring[slot][:nbytes], True

    try:
        for index, (offset, nbytes) in enumerate(chunks):
            if len(pending) >= limits.max_in_flight:
                retire()
            what = f"{verb} chunk {index + 1}/{len(chunks)}"
            bounced = False
            if sending and source is not None:
                piece = source(offset, nbytes)
                if piece.dtype != torch.uint8 or piece.numel() != nbytes:
                    raise ValueError(f"chunk source gave {piece.numel()} bytes for {nbytes}")
            elif sending:
                assert isinstance(arena, torch.Tensor)
                piece = arena[offset : offset + nbytes]
            else:
                piece, bounced = destination(index, offset, nbytes)
                populate(piece)
            pending.append((post(piece, Tag.CHUNK, what), index, offset, piece, bounced))
        while pending:
            retire()
    except BaseException:
        # Settle what is still posted before giving up on the arena, so that nothing
        # reads from it (the caller may overwrite it) or writes into it (the caller
        # will not trust it) after this returns. After a transport failure Gloo has
        # closed the connection and these waits fail at once; after anything else
        # (a progress callback raised) they finish or time out.
        for work, *_ in pending:
            with contextlib.suppress(RuntimeError):
                link.edge.wait(work)
        raise

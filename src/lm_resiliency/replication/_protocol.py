"""The two halves of one transfer on an edge: offering an arena and accepting it.

See :mod:`lm_resiliency.replication._wire` for the message sequence. Both halves
raise :class:`~lm_resiliency.errors.ReplicationError` naming the rank, the peer,
the step and the operation. A clean rejection (bad header, failed allocation)
leaves the edge usable; a transport failure, a timeout or a protocol slip marks
it broken so both endpoints rebuild it before their next transfer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lm_resiliency.capture.layout import Layout
from lm_resiliency.capture.target import Target
from lm_resiliency.errors import ReplicationError
from lm_resiliency.replication._edge import Edge
from lm_resiliency.replication._link import (
    Allocator,
    ChunkSink,
    ChunkSource,
    Link,
    TransferLimits,
    Validator,
    stream,
)
from lm_resiliency.replication._wire import Frame, Kind, Tag, bytes_tensor, empty_frame
from lm_resiliency.replication.header import check_header, decode_header

_T = TypeVar("_T")

_MAX_REASON_BYTES = 4096
_MAX_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Received:
    """A peer's arena and header, fully received and validated.

    ``arena`` is the tensor ``recv_alloc`` returned; its first ``layout.total_bytes``
    bytes now hold the owner's state for ``step`` (or ``target``, see there).
    """

    owner_rank: int
    step: int
    header: dict[str, Any]
    layout: Layout
    arena: torch.Tensor
    trailer: bytes = b""
    target: Target | None = None
    """Set when ``recv_alloc`` returned a target: the bytes are in its live tensors and
    ``arena`` is empty."""

    @property
    def state_document(self) -> dict[str, Any]:
        """The owner's non-tensor state document."""
        doc: dict[str, Any] = self.header["state_document"]
        return doc


@contextlib.contextmanager
def _settling_failures(edge: Edge, step: int) -> Iterator[None]:
    """Drop the edge when anything but a ReplicationError escapes a transfer, and give
    up ``step`` on an edge a failure left broken.

    Such an exception (a failing ``progress`` callback, an interrupt) leaves
    operations posted on the edge that nobody will complete; Gloo would then
    stall the stream, so both sides must rebuild it. Giving the step up tells a
    peer that comes to rebuild the edge for it later that nobody will meet it.
    """
    try:
        yield
    except ReplicationError:
        if edge.broken:
            edge.give_up(step)
        raise
    except BaseException:
        edge.mark_broken()
        edge.give_up(step)
        raise


def _opening(link: Link, fresh: bool, first_message: Callable[[], _T]) -> _T:
    """Run a transfer's first message, rebuilding the edge and retrying once if needed.

    The first message can fail on an edge that looked healthy here because the
    peer dropped it after a failure this rank never saw (it finished its side of
    the last transfer just before the peer gave up), or because the peer came so
    late that this rank timed out. The peer then rebuilds the edge for this step,
    so doing the same here meets it; a peer that gave this step up says so at
    once. An edge rebuilt for this very transfer is not retried: its peer is
    really gone or late.
    """
    try:
        return first_message()
    except ReplicationError as exc:
        if fresh or not link.edge.broken:
            raise
        first_failure = exc
    try:
        link.edge.ensure(link.step)
    except ReplicationError as exc:
        raise ReplicationError(f"{first_failure}; then {exc}") from exc
    return first_message()


@dataclass(frozen=True)
class Outgoing:
    """What one offer sends after its header: ``total_bytes`` from ``arena`` or
    ``source``, then (when ``trailer_bytes`` > 0) the ``trailer()`` bytes."""

    total_bytes: int
    arena: torch.Tensor | None = None
    source: ChunkSource | None = None
    trailer_bytes: int = 0
    trailer: Callable[[], bytes] | None = None


def offer(
    edge: Edge, step: int, blob: bytes | None, out: Outgoing | None, limits: TransferLimits
) -> None:
    """Send one arena (or a SKIP notice when ``blob`` is None) to the edge's peer.

    Returns once the peer acknowledged ``step`` and every byte; raises
    ``ReplicationError`` on rejection, mismatch, timeout or a lost peer.
    """
    with _settling_failures(edge, step):
        _offer(edge, step, blob, out, limits)


def _offer(
    edge: Edge, step: int, blob: bytes | None, out: Outgoing | None, limits: TransferLimits
) -> None:
    link = Link(edge, step, "send")
    fresh = edge.ensure(step)
    if blob is None or out is None:

        def skip() -> None:
            notice = Frame(Kind.SKIP, step).pack()
            link.wait(link.send(notice, Tag.OFFER, "send skip notice"), "send skip notice")

        _opening(link, fresh, skip)
        raise link.error("replicate", "this rank had no state to send (skipped the cycle)")
    total_bytes = out.total_bytes

    def post_offer() -> tuple[Any, Any, torch.Tensor]:
        frame = Frame(Kind.OFFER, step, len(blob), limits.chunk_bytes).pack()
        offer_work = link.send(frame, Tag.OFFER, "send offer")
        header_work = link.send(bytes_tensor(blob), Tag.HEADER, "send header")
        verdict_buf = empty_frame()
        verdict_work = link.recv(verdict_buf, Tag.VERDICT, "receive header verdict")
        link.wait(offer_work, "send offer")
        return header_work, verdict_work, verdict_buf

    header_work, verdict_work, verdict_buf = _opening(link, fresh, post_offer)
    # The verdict comes before waiting on the header: a peer that refuses the offer
    # outright never consumes the header bytes.
    link.wait(verdict_work, "receive header verdict")
    try:
        verdict = Frame.unpack(verdict_buf)
    except ReplicationError as exc:
        raise link.protocol_error("receive header verdict", str(exc)) from None
    if verdict.step != step:
        raise link.protocol_error("receive header verdict", f"verdict is for step {verdict.step}")
    if verdict.kind == Kind.REJECT:
        reason = _recv_reason(link, verdict.a)
        if verdict.b:
            edge.mark_broken()
        else:
            link.wait(header_work, "send header")
        raise link.error("replicate", f"peer rejected the header: {reason}")
    link.wait(header_work, "send header")
    if verdict.kind != Kind.ACCEPT:
        raise link.protocol_error("receive header verdict", f"unexpected {verdict.kind.name}")
    ack_buf = empty_frame()
    ack_work = link.recv(ack_buf, Tag.ACK, "receive ack")
    stream(link, out.arena, total_bytes, limits.chunk_bytes, limits, source=out.source)
    if out.trailer_bytes:
        assert out.trailer is not None
        trailer = out.trailer()
        if len(trailer) != out.trailer_bytes:
            raise ValueError(f"trailer has {len(trailer)} bytes, announced {out.trailer_bytes}")
        link.wait(link.send(bytes_tensor(trailer), Tag.TRAILER, "send trailer"), "send trailer")
    link.wait(ack_work, "receive ack")
    try:
        ack = Frame.unpack(ack_buf)
    except ReplicationError as exc:
        raise link.protocol_error("receive ack", str(exc)) from None
    if ack.kind != Kind.ACK or ack.step != step or ack.a != total_bytes:
        raise link.protocol_error(
            "receive ack",
            f"peer acknowledged {ack.kind.name} step {ack.step} with {ack.a} bytes, "
            f"expected ACK step {step} with {total_bytes} bytes",
        )


def _recv_reason(link: Link, nbytes: int) -> str:
    if not 0 < nbytes <= _MAX_REASON_BYTES:
        return "(no reason given)"
    buf = torch.empty(nbytes, dtype=torch.uint8)
    link.wait(link.recv(buf, Tag.REASON, "receive rejection reason"), "receive rejection reason")
    return buf.numpy().tobytes().decode("utf-8", errors="replace")


def _reject(link: Link, reason: str, *, dirty: bool) -> None:
    blob = reason.encode("utf-8")[:_MAX_REASON_BYTES] or b"?"
    frame = Frame(Kind.REJECT, link.step, len(blob), int(dirty)).pack()
    works = [
        link.send(frame, Tag.VERDICT, "send rejection"),
        link.send(bytes_tensor(blob), Tag.REASON, "send rejection"),
    ]
    for work in works:
        link.wait(work, "send rejection")
    if dirty:
        link.edge.mark_broken()


def accept(
    edge: Edge,
    step: int,
    *,
    owner_rank: int,
    run_id: str,
    recv_alloc: Allocator,
    validate: Validator | None,
    limits: TransferLimits,
    sink: ChunkSink | None = None,
) -> Received:
    """Receive one arena of ``owner_rank`` for ``step`` from the edge's peer.

    The header is checked (:func:`~lm_resiliency.replication.header.check_header`,
    then ``validate``) and ``recv_alloc`` called before any arena byte is
    accepted; a failed check is sent back to the peer as a rejection and raised
    here as ``ReplicationError``. ``sink`` sees each chunk once it arrived; a
    trailer the header announces ends up in ``Received.trailer``.
    """
    with _settling_failures(edge, step):
        return _accept(
            edge,
            step,
            owner_rank=owner_rank,
            run_id=run_id,
            recv_alloc=recv_alloc,
            validate=validate,
            limits=limits,
            sink=sink,
        )


def _accept(
    edge: Edge,
    step: int,
    *,
    owner_rank: int,
    run_id: str,
    recv_alloc: Allocator,
    validate: Validator | None,
    limits: TransferLimits,
    sink: ChunkSink | None,
) -> Received:
    link = Link(edge, step, "recv")
    fresh = edge.ensure(step)
    offer_frame = _opening(link, fresh, lambda: link.frame(Tag.OFFER, "receive offer"))
    if offer_frame.kind == Kind.SKIP:
        raise link.error(
            "replicate", f"peer had no state to send for step {offer_frame.step} (skipped)"
        )
    if offer_frame.kind != Kind.OFFER:
        raise link.protocol_error("receive offer", f"unexpected {offer_frame.kind.name}")
    header_bytes, chunk_bytes = offer_frame.a, offer_frame.b
    if not 0 < header_bytes <= limits.max_header_bytes or not 0 < chunk_bytes <= _MAX_CHUNK_BYTES:
        reason = (
            f"offer of a {header_bytes}-byte header in {chunk_bytes}-byte chunks exceeds "
            f"the limits (header <= {limits.max_header_bytes} bytes, chunk <= "
            f"{_MAX_CHUNK_BYTES} bytes)"
        )
        # The header bytes stay unconsumed on the edge: both sides rebuild it.
        _reject(link, reason, dirty=True)
        raise link.error("validate offer", reason)
    blob = torch.empty(header_bytes, dtype=torch.uint8)
    link.wait(link.recv(blob, Tag.HEADER, "receive header"), "receive header")
    try:
        if offer_frame.step != step:
            raise ReplicationError(f"offer is for step {offer_frame.step}, expected step {step}")
        header = decode_header(blob.numpy().tobytes())
        layout = check_header(header, run_id=run_id, owner_rank=owner_rank, step=step)
        trailer_bytes = _trailer_bytes(header, limits)
        if validate is not None:
            validate(header)
        arena = recv_alloc(header)
        _check_destination(arena, layout.total_bytes)
    except Exception as exc:  # any reason to refuse goes back to the owner first
        _reject(link, f"{type(exc).__name__}: {exc}", dirty=False)
        raise link.error("validate header", f"{type(exc).__name__}: {exc}") from exc
    link.wait(link.send(Frame(Kind.ACCEPT, step).pack(), Tag.VERDICT, "send accept"), "send accept")
    stream(link, arena, layout.total_bytes, chunk_bytes, limits, sink=sink)
    trailer = b""
    if trailer_bytes:
        buf = torch.empty(trailer_bytes, dtype=torch.uint8)
        link.wait(link.recv(buf, Tag.TRAILER, "receive trailer"), "receive trailer")
        trailer = buf.numpy().tobytes()
    ack = Frame(Kind.ACK, step, layout.total_bytes).pack()
    link.wait(link.send(ack, Tag.ACK, "send ack"), "send ack")
    if isinstance(arena, Target):
        empty = torch.empty(0, dtype=torch.uint8)
        return Received(owner_rank, step, header, layout, empty, trailer, arena)
    return Received(owner_rank, step, header, layout, arena, trailer)


def _trailer_bytes(header: dict[str, Any], limits: TransferLimits) -> int:
    value = header.get("trailer_bytes", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReplicationError(f"header field trailer_bytes={value!r} is not a byte count")
    if value > limits.max_header_bytes:
        raise ReplicationError(
            f"a {value}-byte trailer exceeds the limit of {limits.max_header_bytes} bytes"
        )
    return value


def _check_destination(arena: object, total_bytes: int) -> None:
    if isinstance(arena, Target):
        if arena.total_bytes != total_bytes:
            raise ValueError(
                f"recv_alloc returned a target of {arena.total_bytes} bytes for {total_bytes}"
            )
        return
    if not isinstance(arena, torch.Tensor):
        raise TypeError(f"recv_alloc returned {type(arena).__name__}, not a tensor")
    if (
        arena.dtype != torch.uint8
        or arena.dim() != 1
        or arena.device.type != "cpu"
        or not arena.is_contiguous()
        or arena.numel() < total_bytes
    ):
        raise ValueError(
            f"recv_alloc must return a contiguous flat uint8 CPU tensor of >= {total_bytes} "
            f"bytes, got {arena.dtype} {tuple(arena.shape)} on {arena.device}"
        )

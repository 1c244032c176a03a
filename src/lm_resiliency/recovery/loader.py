"""Collective loading of one agreed step from the cheapest source of every rank.

Call order (every rank, same arguments derived from the same gathered table)::

    outcome = fetch_step(step, table, ctx)

Phases, each ending in agreement so no rank applies a step another rank could
not obtain:

1. *prepare*: a rank whose source is local (own memory / own disk) reads and
   validates its state; a rank that holds the replica a peer needs finds it in
   memory or opens its file and validates everything but the data checksums.
   Failures are all-reduced.
2. *transfer*: replicas go home over the replication channel (owner <- holder),
   with the same header validation as replication and a CRC-32C per chunk. A
   replica on disk is read and sent chunk by chunk, its stored checksums
   travelling with it, so the owner verifies the file's bytes end to end.
   Failures are all-reduced.

Either failure makes every rank return ``None`` for this step; the caller then
walks back to an older common step (LATEST) or fails closed (VERIFIED).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.capture.layout import Layout
from lm_resiliency.persistence.reader import ShardReader
from lm_resiliency.recovery.availability import Source
from lm_resiliency.replication import PairingPlan, ReplicationChannel, make_header
from lm_resiliency.replication.transfer import TransferKey, recv_checkpoint, send_checkpoint

log = logging.getLogger(__name__)


@dataclass
class Material:
    """A validated state: layout, a private arena holding its bytes, its document."""

    layout: Layout
    arena: torch.Tensor
    document: dict[str, Any]


_PEER_SOURCES = (Source.PEER_MEMORY, Source.PEER_DISK)

Served = Material | ShardReader
"""A replica ready to be handed home: in memory, or an open, header-validated file."""


@dataclass
class FetchContext:
    """What :func:`fetch_step` needs from the manager of one rank."""

    rank: int
    group: dist.ProcessGroup | None
    run_id: str
    plan: PairingPlan | None
    channel: ReplicationChannel | None
    own_memory: Callable[[int], Material | None]
    own_disk: Callable[[int], Material | None]
    held_memory: Callable[[int], Material | None]
    held_disk: Callable[[int], ShardReader | None]


@dataclass
class Fetched:
    material: Material
    source: Source
    bytes_moved: int
    phases_s: dict[str, float]
    """``prepare`` (local reads and checks, agreed) and ``transfer`` (replicas home, agreed)."""


def _any_failed(failed: bool, group: dist.ProcessGroup | None) -> bool:
    if group is None:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _load_local(ctx: FetchContext, source: Source, step: int) -> Served | None:
    getter: Callable[[int], Served | None] = {
        Source.OWN_MEMORY: ctx.own_memory,
        Source.OWN_DISK: ctx.own_disk,
        Source.PEER_MEMORY: ctx.held_memory,
        Source.PEER_DISK: ctx.held_disk,
    }[source]
    try:
        return getter(step)
    except Exception as exc:  # a source that fails validation is simply unavailable
        log.warning("rank %d: %s of step %d unusable: %s", ctx.rank, source.label, step, exc)
        return None


def _key(step: int, *, src: int, dst: int, meta: tuple[str, int]) -> TransferKey:
    return TransferKey(f"gemini/step-{step}/owner-{dst}", src, dst, step, meta[0], meta[1])


def _exchange_metadata(served: Served | None, ctx: FetchContext) -> dict[int, tuple[str, int]]:
    """Collective: owner rank -> (layout digest, bytes) of the replica its holder serves."""
    mine = ("", 0) if served is None else (served.layout.digest, served.layout.total_bytes)
    plan = ctx.plan
    if ctx.group is None or plan is None or not plan.has_peer:
        return {}
    world = dist.get_world_size(ctx.group)
    row = torch.zeros(17, dtype=torch.int64)
    if served is not None:
        row[:16] = torch.tensor(list(bytes.fromhex(mine[0])), dtype=torch.int64)
        row[16] = mine[1]
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=ctx.group)
    # rank h serves the replica of recv_from(h)
    return {
        plan.recv_from(h): (bytes(r[:16].tolist()).hex(), int(r[16])) for h, r in enumerate(rows)
    }


def fetch_step(step: int, table: Sequence[dict[int, Source]], ctx: FetchContext) -> Fetched | None:
    """Collective: this rank's validated state of ``step``, or ``None`` on every rank."""
    mine = table[ctx.rank][step]
    plan = ctx.plan
    owner = plan.recv_from(ctx.rank) if plan is not None and plan.has_peer else None
    serve_source = table[owner].get(step) if owner is not None else None
    must_serve = serve_source in _PEER_SOURCES
    must_receive = mine in _PEER_SOURCES

    # Phase 1: read and validate everything local (own state, replica to serve).
    t0 = time.perf_counter()
    local = None if must_receive else _load_local(ctx, mine, step)
    served = _load_local(ctx, serve_source, step) if must_serve and serve_source else None
    try:
        failed = (not must_receive and local is None) or (must_serve and served is None)
        if _any_failed(failed, ctx.group):
            return None
        t1 = time.perf_counter()
        # Every rank sees the same table: when no rank needs a replica, nobody moves one.
        if any(t[step] in _PEER_SOURCES for t in table):
            ok, received = _move_replicas(step, ctx, owner, served, must_receive=must_receive)
        else:
            ok, received = True, None
    finally:
        if isinstance(served, ShardReader):
            served.close()
    if not ok:
        return None
    phases = {"prepare": t1 - t0, "transfer": time.perf_counter() - t1}
    if received is not None:
        return Fetched(received, mine, received.layout.total_bytes, phases)
    assert isinstance(local, Material)
    return Fetched(local, mine, 0, phases)


def _move_replicas(
    step: int,
    ctx: FetchContext,
    owner: int | None,
    served: Served | None,
    *,
    must_receive: bool,
) -> tuple[bool, Material | None]:
    """Phase 2 (collective): replicas travel home, both directions of a rank at once.

    ``owner`` is the rank whose replica this rank holds (``served`` is it, if needed).
    Returns whether every rank's transfers succeeded and, if this rank had to
    receive, its state.
    """
    plan = ctx.plan
    received: list[Material] = []
    errors: list[BaseException] = []

    def receive() -> None:
        assert ctx.channel is not None and plan is not None
        try:
            key = _key(step, src=plan.send_to(ctx.rank), dst=ctx.rank, meta=sizes[ctx.rank])
            got = recv_checkpoint(ctx.channel, key, owner_rank=ctx.rank)
            received.append(Material(got.layout, got.arena, got.state_document))
        except Exception as exc:
            errors.append(exc)

    def serve() -> None:
        assert ctx.channel is not None and owner is not None and served is not None
        try:
            key = _key(step, src=ctx.rank, dst=owner, meta=sizes[owner])
            if isinstance(served, ShardReader):
                header = make_header(ctx.run_id, owner, step, served.layout, served.state_document)
                send_checkpoint(ctx.channel, key, header=header, reader=served)
            else:
                header = make_header(ctx.run_id, owner, step, served.layout, served.document)
                send_checkpoint(ctx.channel, key, header=header, arena=served.arena)
        except Exception as exc:
            errors.append(exc)

    # Both endpoints bind the transfer to the same tensor metadata: the holder's.
    sizes = _exchange_metadata(served, ctx)

    threads = []
    if must_receive:
        threads.append(threading.Thread(target=receive, name="lmr-recover-recv"))
    if served is not None:
        threads.append(threading.Thread(target=serve, name="lmr-recover-send"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        log.warning("rank %d: moving a replica of step %d failed: %s", ctx.rank, step, exc)
    failed = bool(errors) or (must_receive and not received)
    if _any_failed(failed, ctx.group):
        return False, None
    return True, received[0] if must_receive else None

"""Collective loading of one agreed step, trying every source before anybody walks back.

Call order (every rank, same arguments derived from the same gathered table)::

    fetched = fetch_step(step, options, ctx)

Each rank has, for ``step``, a list of sources cheapest first (own memory,
own disk, its peer's memory, its peer's disk). The fetch runs in rounds until
every rank holds a validated, decoded state or some rank has no source left:

1. *prepare*: every unsettled rank whose current source is local opens it,
   validates it and decodes its document; every rank that serves its peer
   (the peer's current source is remote) opens what it serves. A reason per
   rank is all-gathered, so every rank knows who failed and why.
2. *transfer*: replicas go home (owner <- server) over the replication
   channel with a CRC-32C per chunk, then the owner decodes; again a reason
   per rank is all-gathered.

A rank whose source failed moves to its next source for the *same* step in
the next round; only when some rank has none left does the fetch return
``None`` on every rank (the caller walks back, or fails closed in verified
mode). Every check that can fail on one rank (schema, decode, CRC, identity,
size, transfer) happens before the final agreement, so a step is never
returned on some ranks while others raise. Nothing is consumed here: the
returned :attr:`Fetched.consume` hands an own-memory slot over, and the caller
calls it only once the whole recovery succeeded (the state is applied); until
then the slot stays committed and attachable by a restarted process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lm_resiliency.capture.target import Target
from lm_resiliency.control import ControlPlane
from lm_resiliency.knobs import OWN_STORAGE_BYTES
from lm_resiliency.persistence.reader import ShardReader
from lm_resiliency.recovery.availability import Options, Source
from lm_resiliency.recovery.sources import Material, Served, StepSource
from lm_resiliency.replication import PairingPlan, ReplicationChannel, make_header
from lm_resiliency.replication.transfer import TransferKey, recv_checkpoint, send_checkpoint
from lm_resiliency.state import decode_state

log = logging.getLogger(__name__)


@dataclass
class FetchContext:
    """What :func:`fetch_step` needs from the manager of one rank."""

    rank: int
    world_size: int
    control: ControlPlane
    run_id: str
    plan: PairingPlan | None
    channel: ReplicationChannel | None
    sources: dict[Source, StepSource]
    """This rank's own sources (OWN_MEMORY, OWN_DISK) and what it serves its peer
    (PEER_MEMORY, PEER_DISK: the serve side)."""


@dataclass
class Fetched:
    state: Any
    source: Source
    bytes_moved: int
    phases_s: dict[str, float]
    sources: list[Source]
    """The source every rank finally used, in rank order."""
    problems: list[str] = field(default_factory=list)
    """Sources that failed on the way (rank, source, reason), tried before the one used."""
    consume: Callable[[], object] | None = None
    """Hands this rank's own-memory slot over (``None`` for a source that is not consumed);
    call it only after the recovered state was applied."""
    in_place: bool = False
    """The state's tensors are the fetch's target tensors (restored in place)."""


@dataclass
class Unusable:
    """Why ``step`` could not be loaded: every failed source of every rank."""

    step: int
    problems: list[str]


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "reason", None) or type(exc).__name__
    return f"{code}: {str(exc)[:240]}"


def decode(material: Material, target: Target | None = None) -> tuple[Any, bool]:
    """The state tree of ``material`` and whether it holds ``target``'s tensors.

    A material ``filled`` into ``target``, or one in memory whose layout is the
    target's (copied into it here), decodes onto the target's live tensors; any
    other decodes onto views of its arena. Raises ``StateSchemaError`` for a bad
    document.
    """
    if material.filled:
        assert target is not None
        return decode_state(material.document, target.tensors), True
    if target is not None and target.matches(material.layout):
        target.write(0, material.arena[: material.layout.total_bytes])
        return decode_state(material.document, target.tensors), True
    views = material.layout.views(material.arena)
    tensors = [v.clone() if v.nbytes < OWN_STORAGE_BYTES else v for v in views]
    return decode_state(material.document, tensors), False


class _Round:
    """One rank's view of the fetch: which source each rank is on, what failed, who settled."""

    def __init__(self, step: int, options: Options, ctx: FetchContext) -> None:
        self.step = step
        self.ctx = ctx
        self.queues = [list(o.get(step, [])) for o in options]
        self.settled = [False] * ctx.world_size
        self.problems: list[str] = []

    def choice(self, rank: int) -> Source | None:
        queue = self.queues[rank]
        return queue[0] if queue else None

    def fail(self, rank: int, why: str) -> None:
        source = self.queues[rank].pop(0)
        self.problems.append(f"rank {rank} {source.label}: {why}")

    def stuck(self) -> bool:
        return any(not self.settled[r] and not self.queues[r] for r in range(self.ctx.world_size))

    def owner_served_by(self, rank: int) -> int | None:
        plan = self.ctx.plan
        return plan.recv_from(rank) if plan is not None and plan.has_peer else None

    def needs_serving(self, owner: int | None) -> Source | None:
        if owner is None or self.settled[owner]:
            return None
        c = self.choice(owner)
        return c if c is not None and c.remote else None


def fetch_step(
    step: int, options: Options, ctx: FetchContext, target: Target | None = None
) -> Fetched | Unusable:
    """Collective: this rank's validated state of ``step``, or :class:`Unusable` on every rank.

    ``target``: live tensors to restore into (read, received or copied straight into
    them when the step's layout is theirs; ``Fetched.in_place`` says whether it was).
    Their bytes are garbage after an :class:`Unusable`, and may be overwritten by a
    source that failed before the one used.
    """
    rnd = _Round(step, options, ctx)
    me = ctx.rank
    state: Any = None
    mine: Material | None = None
    moved = 0
    used: Source | None = None
    in_place = False
    phases = {"prepare": 0.0, "transfer": 0.0, "decode": 0.0}

    def timed_decode(material: Material) -> Any:
        nonlocal in_place
        t = time.perf_counter()
        try:
            tree, in_place = decode(material, target)
            return tree
        finally:
            phases["decode"] += time.perf_counter() - t

    while not all(rnd.settled):
        if rnd.stuck():
            return Unusable(step, rnd.problems)
        # Phase 1: local sources and what this rank serves.
        t0 = time.perf_counter()
        remote = [rnd.needs_serving(r) for r in range(ctx.world_size)]  # as the round starts
        owner = rnd.owner_served_by(me)
        serve_kind = remote[owner] if owner is not None else None
        local_err = serve_err = ""
        served: Served | None = None
        choice = rnd.choice(me)
        if not rnd.settled[me] and choice is not None and not choice.remote:
            try:
                opened = ctx.sources[choice].open(step, target)
                assert isinstance(opened, Material)
                state, mine, used = timed_decode(opened), opened, choice
            except Exception as exc:
                local_err = _reason(exc)
        if serve_kind is not None:
            try:
                served = ctx.sources[serve_kind].open(step)
            except Exception as exc:
                serve_err = _reason(exc)
        try:
            codes = _gather(ctx, local_err, serve_err, f"load step {step}: prepare")
            movers = []
            for r, (local, _) in enumerate(codes):
                if remote[r] is not None:
                    server = _server_of(ctx, r)
                    why = codes[server][1] if server is not None else "no server"
                    if why:
                        rnd.fail(r, f"its server rank {server} could not open it: {why}")
                    else:
                        movers.append(r)
                elif not rnd.settled[r] and rnd.choice(r) is not None:
                    if local:
                        rnd.fail(r, local)
                    else:
                        rnd.settled[r] = True
            phases["prepare"] += time.perf_counter() - t0
            if not movers:
                continue
            # Phase 2: replicas go home, for owners whose server opened its copy.
            t1 = time.perf_counter()
            recv_err, send_err, got = _move(step, ctx, owner, movers, served, target)
            if got is not None:
                try:
                    state, mine, used = timed_decode(got), got, rnd.choice(me)
                    moved = got.layout.total_bytes
                except Exception as exc:
                    recv_err = _reason(exc)
            codes = _gather(ctx, recv_err, send_err, f"load step {step}: transfer")
            for r in movers:
                server = _server_of(ctx, r)
                recv, send = codes[r][0], codes[server][1] if server is not None else ""
                if recv or send:
                    rnd.fail(r, recv or f"sending from rank {server} failed: {send}")
                else:
                    rnd.settled[r] = True
            phases["transfer"] += time.perf_counter() - t1
        finally:
            if isinstance(served, ShardReader):
                served.close()
    assert mine is not None and used is not None
    final = [_or_fallback(rnd.choice(r)) for r in range(ctx.world_size)]
    if target is not None and not in_place:
        log.warning(
            "rank %d: load(into=...) was not restored in place: the layout of step %d "
            "(%s) is not the one of the given tensors (%s); a fresh state is returned",
            me,
            step,
            mine.layout.digest,
            target.layout.digest,
        )
    # A state copied into the target does not alias its slot: nothing to hand over.
    consume = None if in_place else mine.consume
    return Fetched(state, used, moved, phases, final, rnd.problems, consume, in_place)


def _or_fallback(source: Source | None) -> Source:
    return Source.FALLBACK if source is None else source


def _server_of(ctx: FetchContext, rank: int) -> int | None:
    plan = ctx.plan
    return plan.send_to(rank) if plan is not None and plan.has_peer else None


def _gather(ctx: FetchContext, a: str, b: str, name: str) -> list[tuple[str, str]]:
    return [(g[0], g[1]) for g in ctx.control.gather_reasons((a, b), name=name)]


def _key(step: int, *, src: int, dst: int, meta: tuple[str, int]) -> TransferKey:
    return TransferKey(f"gemini/step-{step}/owner-{dst}", src, dst, step, meta[0], meta[1])


def _move(
    step: int,
    ctx: FetchContext,
    owner: int | None,
    movers: list[int],
    served: Served | None,
    target: Target | None = None,
) -> tuple[str, str, Material | None]:
    """Phase 2 (collective): replicas travel home, both directions of a rank at once.

    ``owner`` is the rank this one serves. Returns this rank's receive and send
    errors and, if it received, its material.
    """
    me = ctx.rank
    must_serve = owner in movers and served is not None
    must_receive = me in movers
    # Both endpoints bind the transfer to the same tensor metadata: the server's.
    mine = ("", 0) if not must_serve or served is None else _meta(served)
    metas = [
        tuple(json.loads(b))
        for b in ctx.control.all_gather_bytes(
            json.dumps(list(mine)).encode(), name=f"load step {step}: transfer metadata"
        )
    ]
    received: list[Material] = []
    errors = {"recv": "", "send": ""}

    def receive() -> None:
        assert ctx.channel is not None
        server = _server_of(ctx, me)
        assert server is not None
        try:
            key = _key(step, src=server, dst=me, meta=(metas[server][0], metas[server][1]))
            got = recv_checkpoint(ctx.channel, key, owner_rank=me, into=target)
            filled = got.target is not None
            received.append(Material(got.layout, got.arena, got.state_document, filled=filled))
        except Exception as exc:
            errors["recv"] = _reason(exc)

    def serve() -> None:
        assert ctx.channel is not None and owner is not None and served is not None
        try:
            key = _key(step, src=me, dst=owner, meta=(metas[me][0], metas[me][1]))
            if isinstance(served, ShardReader):
                header = make_header(ctx.run_id, owner, step, served.layout, served.state_document)
                send_checkpoint(ctx.channel, key, header=header, reader=served)
            else:
                header = make_header(ctx.run_id, owner, step, served.layout, served.document)
                send_checkpoint(
                    ctx.channel, key, header=header, arena=served.arena, slot_crcs=served.crcs
                )
        except Exception as exc:
            errors["send"] = _reason(exc)

    jobs: list[Callable[[], None]] = []
    if must_receive and ctx.channel is not None:
        jobs.append(receive)
    elif must_receive:
        errors["recv"] = "no replication channel on this rank"
    if must_serve:
        jobs.append(serve)
    threads = [threading.Thread(target=j, name="lmr-recover-move") for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for what, err in errors.items():
        if err:
            log.warning("rank %d: %s of a replica of step %d failed: %s", me, what, step, err)
    return errors["recv"], errors["send"], (received[0] if received else None)


def _meta(served: Served) -> tuple[str, int]:
    return served.layout.digest, served.layout.total_bytes

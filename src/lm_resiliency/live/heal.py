"""Heal a joining replica from a member's live state (docs/live-membership.md §6.2).

The state is any tree the capture codec encodes (:func:`lm_resiliency.state.encode_state`):
nested dicts/lists of tensors and JSON-able values, e.g. the front door's capture tree
(``frontdoor/tree.py``: model, optimizer, scheduler, sampler position, ``step``). The donor
streams it over a :class:`~lm_resiliency.replication.TorchTransfer` (the replication wire:
a JSON header, the tensor bytes in chunks, one CRC-32C per chunk, an ack) on a two-rank Gloo
group under ``Keys.heal_prefix(E, joiner, g)`` of the coordinator store; the tensors are read
straight from the live tensors chunk by chunk (no staging copy of the whole state). The
joiner gets the tree back with tensors that are views into the received arena, and loads it
through its own restore path (``load``), e.g. ``CaptureTree.apply``.

Call order::

    # every member, after committing step s (cheap: the admission is cached by the heartbeat)
    record = heal.at_boundary(membership, s, lambda: state_tree)
    if record is not None:        # an admission took place at s (or failed): a new epoch
        rebuild the cross-replica group for record (members may have changed)

    # the joiner (Membership.joining), once its model and optimizer exist
    record, healed = heal.join(membership, load)   # load(tree) -> the state tree as loaded
    ...continue at step healed.step + 1 in epoch record.epoch

Every wait is bounded: the transfer's by ``heal_timeout_s`` (each wait, naming the peer),
the outcome's by the coordinator's decisions (donor lost, joiner lost or failed, both leased)
with ``join_timeout_s`` as the backstop. No member's state changes during a heal.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lm_resiliency._killpoints import kill_point
from lm_resiliency.capture.layout import Layout
from lm_resiliency.detection.digest import digest_tensors
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.knobs import MAX_IN_FLIGHT_CHUNKS, REPLICATION_CHUNK_BYTES
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import EpochRecord, Keys
from lm_resiliency.live.membership import Membership
from lm_resiliency.live.view import CoordinatorLost, Evicted
from lm_resiliency.replication.torch_transfer import TorchTransfer
from lm_resiliency.replication.transfer import TransferKey
from lm_resiliency.state import decode_state, encode_state
from lm_resiliency.state.codec import EncodedState
from lm_resiliency.state.schema import dumps_document

__all__ = [
    "HEAL_FORMAT",
    "HealFailed",
    "HealPeer",
    "Healed",
    "at_boundary",
    "join",
    "receive",
    "serve",
    "state_digest",
]

_log = logging.getLogger(__name__)

HEAL_FORMAT = "lm_resiliency.heal/1"
_DONOR, _JOINER = 0, 1
"""The two endpoints' ranks in the heal's two-rank group."""


class HealFailed(ResiliencyError):
    """A heal did not complete (the message names the peer, the step and why)."""


class HealPeer(Protocol):
    """What :func:`serve` and :func:`receive` need of an endpoint (a ``Membership`` is one)."""

    @property
    def keys(self) -> Keys: ...

    @property
    def group_rank(self) -> int: ...

    @property
    def config(self) -> LiveConfig: ...

    def store(self) -> dist.Store: ...


@dataclass(frozen=True)
class Healed:
    """What a joiner received: the tree (tensors view the received arena) and its facts."""

    tree: Any
    step: int
    digest: str
    """The donor's :func:`state_digest` of its state (what the joiner's load must match)."""
    nbytes: int
    seconds: float
    """Waiting for the donor's key to the last byte checked."""
    transfer_s: float = 0.0
    """The transfer itself: the rendezvous, header, chunks, trailer and ack."""


def state_digest(tree: Any) -> str:
    """One digest of a state tree: its tensors' bytes, shapes and dtypes, and its JSON part."""
    return _digest(encode_state(tree))


def _digest(enc: EncodedState) -> str:
    doc = hashlib.blake2b(dumps_document(enc.document).encode(), digest_size=8).hexdigest()
    return f"{digest_tensors(enc.tensors):016x}{doc}"


def _step(record: EpochRecord) -> int:
    if record.reason != "admit" or record.heal is None:
        raise ValueError(f"epoch {record.epoch} ({record.reason!r}) schedules no heal")
    return int(record.heal["step"])


def _prefix(m: HealPeer, record: EpochRecord) -> str:
    assert record.heal is not None
    return m.keys.heal_prefix(record.epoch, record.heal["joiner"], m.group_rank)


def _transfer(m: HealPeer, rank: int, prefix: str, chunk_bytes: int) -> TorchTransfer:
    return TorchTransfer(
        run_id=m.keys.run,
        rank=rank,
        store=m.store(),
        chunk_bytes=chunk_bytes,
        timeout_s=m.config.heal_timeout_s,
        max_in_flight=MAX_IN_FLIGHT_CHUNKS,
        namespace=prefix + "transfer",
    )


class _TreeReader:
    """The tensors of an encoded tree as one arena laid out by ``layout``, read chunk by chunk."""

    def __init__(self, layout: Layout, tensors: Sequence[torch.Tensor], step: int) -> None:
        self._specs = layout.specs
        self._starts = [s.offset_bytes for s in layout.specs]
        self._flat = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]
        self._total = layout.total_bytes
        self._step = step

    @property
    def total_bytes(self) -> int:
        return self._total

    def checksums(self) -> tuple[int, list[int]] | None:
        return None  # computed as the bytes go out

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        if 2 * offset >= self._total:
            kill_point("live.heal_send", step=self._step)  # half the state is on its way
        n = out.numel()
        pos = 0
        i = bisect.bisect_right(self._starts, offset) - 1
        while pos < n:
            spec = self._specs[i]
            start = offset + pos - spec.offset_bytes
            take = min(spec.nbytes - start, n - pos)
            if take > 0:
                out[pos : pos + take].copy_(self._flat[spec.index][start : start + take])
                pos += take
            i += 1


def serve(
    tree: Any,
    membership: HealPeer,
    record: EpochRecord,
    *,
    chunk_bytes: int = REPLICATION_CHUNK_BYTES,
) -> float:
    """On the donor's rank g: stream ``tree`` (its state at h) to the joiner's rank g.

    The tree's digest is computed on a helper thread while the bytes go out (the state does
    not change during a heal) and published after the transfer, for the joiner to check
    its load against. Returns the seconds the transfer took. Raises ``ReplicationError``
    (naming the peer and the step) when the joiner does not arrive within
    ``heal_timeout_s``, refuses, or dies.
    """
    step = _step(record)
    enc = encode_state(tree)
    layout = Layout.from_tensors(enc.tensors, enc.names)
    assert record.heal is not None
    key = TransferKey(
        name=f"heal-r{record.heal['joiner']}",
        src=_DONOR,
        dst=_JOINER,
        step=step,
        layout_digest=layout.digest,
        total_bytes=layout.total_bytes,
    )
    doc = {"format": HEAL_FORMAT, "step": step, "document": enc.document}
    prefix = _prefix(membership, record)
    store = membership.store()
    digest: list[str] = []
    hasher = threading.Thread(target=lambda: digest.append(_digest(enc)), name="lmr-heal-digest")
    hasher.start()
    try:
        store.set(prefix + "key", json.dumps(key.to_json()))
        t0 = time.perf_counter()
        _transfer(membership, _DONOR, prefix, chunk_bytes).send(
            key, layout=layout, state_document=doc, reader=_TreeReader(layout, enc.tensors, step)
        )
        seconds = time.perf_counter() - t0
    finally:
        hasher.join()
    store.set(prefix + "digest", digest[0])
    return seconds


def receive(
    membership: HealPeer,
    record: EpochRecord,
    *,
    chunk_bytes: int = REPLICATION_CHUNK_BYTES,
) -> Healed:
    """On the joiner's rank g: receive the donor's state at h (every wait bounded).

    Every chunk is checked against the CRC-32C the donor computed as it sent it; the donor's
    digest of its state comes with the result (the joiner checks its load against it, see
    :func:`join`). Raises :class:`HealFailed` when the donor publishes no transfer (or no
    digest) within ``heal_timeout_s`` or the admission is superseded first, and
    ``ReplicationError``/``IntegrityError`` from the transport.
    """
    step = _step(record)
    assert record.heal is not None
    donor = f"replica {record.heal['donor']} rank {membership.group_rank}"
    prefix = _prefix(membership, record)
    store = membership.store()
    t0 = time.perf_counter()
    newer = membership.keys.epoch_record(record.epoch + 1)
    _await(membership, prefix + "key", newer, f"{donor} offered no state of step {step}")
    key = TransferKey(**json.loads(store.get(prefix + "key")))
    if key.step != step or key.dst != _JOINER:
        raise HealFailed(f"{donor} offered {key.describe}, not the heal of step {step}")

    def on_chunk(got: int) -> None:
        if 2 * got >= key.total_bytes:
            kill_point("live.heal_recv", step=step)  # half the state has arrived

    # The arena's pages are mapped chunk by chunk by the transport, each just before its
    # receive is posted, so the mapping overlaps the chunks in flight (mapping them all
    # first stalled the heal: fresh pages cost as much as the wire on a VM).
    t1 = time.perf_counter()
    transfer = _transfer(membership, _JOINER, prefix, chunk_bytes)
    received = transfer.recv(key, on_chunk=on_chunk)
    transfer_s = time.perf_counter() - t1
    doc = received.state_document
    if doc.get("format") != HEAL_FORMAT or doc.get("step") != step:
        raise HealFailed(
            f"{donor} sent a state of format {doc.get('format')!r} step {doc.get('step')!r}, "
            f"not {HEAL_FORMAT!r} step {step}"
        )
    tree = decode_state(doc["document"], received.layout.views(received.arena))
    _await(membership, prefix + "digest", newer, f"{donor} published no digest of step {step}")
    digest = bytes(store.get(prefix + "digest")).decode()
    seconds = time.perf_counter() - t0
    return Healed(tree, step, digest, key.total_bytes, seconds, transfer_s)


def _await(peer: HealPeer, key: str, newer: str, what: str) -> None:
    """Poll for ``key`` (bounded by ``heal_timeout_s``; stops early once ``newer`` exists)."""
    store = peer.store()
    deadline = time.monotonic() + peer.config.heal_timeout_s
    while not store.check([key]):
        if store.check([newer]):
            raise HealFailed(f"{what}: the admission ended (the next epoch is out)")
        if time.monotonic() > deadline:
            raise HealFailed(f"{what} within heal_timeout_s={peer.config.heal_timeout_s:g}")
        time.sleep(peer.config.poll_slice_s)


def at_boundary(
    membership: Membership,
    step: int,
    state: Callable[[], Any],
    *,
    chunk_bytes: int = REPLICATION_CHUNK_BYTES,
) -> EpochRecord | None:
    """A member, after committing ``step``: take part in a heal scheduled for ``step``.

    Returns None when no admission is due (the common case: one cached read). At the step
    of an admission every member adopts the ``"admit"`` epoch, the donor serves ``state()``,
    and everyone waits for the outcome, which is returned (adopted): the joiner admitted,
    the admission cancelled (members unchanged), or a loss change (the donor died). A donor
    whose send fails reports it (``fail/<E+1>``), so the coordinator cancels the admission.
    """
    record = membership.admission()
    if record is None:
        return None
    h = _step(record)
    if step < h:
        return None
    assert record.heal is not None
    if step > h:
        raise HealFailed(
            f"the admission of replica {record.heal['joiner']} was scheduled for step {h}, but "
            f"r{membership.replica}g{membership.group_rank} learnt of it only after committing "
            f"step {step}: steps are faster than the heartbeat margin (see "
            "Coordinator.heal_step)"
        )
    membership.enter_admission(record)
    if membership.replica == record.heal["donor"]:
        try:
            seconds = serve(state(), membership, record, chunk_bytes=chunk_bytes)
            _log.info("healed replica %d at step %d in %.3f s", record.heal["joiner"], h, seconds)
        except (ResiliencyError, RuntimeError, OSError) as exc:
            if isinstance(exc, (CoordinatorLost, Evicted)):
                raise
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _log.warning("heal of replica %d failed: %s", record.heal["joiner"], why)
            membership.report_failure(f"heal of replica {record.heal['joiner']} failed: {why}")
    return membership.await_outcome()


def join(
    membership: Membership,
    load: Callable[[Any], Any],
    *,
    chunk_bytes: int = REPLICATION_CHUNK_BYTES,
) -> tuple[EpochRecord, Healed | None]:
    """The joiner: wait for an admission, receive, ``load(tree)``, ack the digest, join.

    ``load`` applies the received tree to this process's state and returns the state tree
    as loaded (same structure); its digest must equal the donor's. A failed receive or load
    is acked as an error, and the joiner waits for the next admission (the next donor, after
    a loss). Returns the epoch that admitted this replica and what was received, or
    ``(record, None)`` when every member left first and the coordinator started a fresh
    membership naming this process (``membership.joining`` is then False: it recovers from
    its own memory, as at a start). Raises ``CoordinatorLost`` when no admission comes
    within ``join_timeout_s``.
    """
    while True:
        record = membership.await_admission()
        if not membership.joining:
            return record, None  # a fresh membership: no heal, recovery from own memory
        try:
            healed = receive(membership, record, chunk_bytes=chunk_bytes)
            digest = state_digest(load(healed.tree))
            if digest != healed.digest:
                raise HealFailed(
                    f"the loaded state of step {healed.step} has digest {digest}, not the "
                    f"donor's {healed.digest}: load() did not restore it exactly"
                )
        except (ResiliencyError, RuntimeError, OSError) as exc:
            if isinstance(exc, (CoordinatorLost, Evicted)):
                raise
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _log.warning("heal at epoch %d failed: %s", record.epoch, why)
            membership.ack_heal(record, error=why[:500])
            membership.await_admitted(record)  # the outcome; this joiner was not admitted
            continue
        membership.ack_heal(record, digest=digest)
        admitted = membership.await_admitted(record)
        if admitted is not None:
            return admitted, healed

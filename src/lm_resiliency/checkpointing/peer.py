"""The peer side of GEMINI: two peer slots filled by replication after every capture.

Runs on the capture engine's completion worker: once ``own_current`` is
complete, :meth:`PeerReplicas.replicate` sends it to ``send_to(rank)`` and
receives ``recv_from(rank)``'s capture of the same step into ``peer_current``
(both directions at once). A replica counts only when both directions completed
for the same step; otherwise the cycle's replica is dropped, the previous
complete peer slot stays, and the failure is logged and counted.

The header carries the owner's CRC-32C per chunk of its slot (computed by its
capture worker); the holder checksums what arrived (on the same worker, off the
training thread) and refuses a replica whose bytes differ: it was damaged in
transit. The verified checksums seal the held slot, so its file is checked
again when a restarted process re-attaches it.

The check runs after the transport's acknowledgement, so the owner is not told
of a refusal: its cycle succeeded, and its own slot is marked ``REPLICATED``
and counted in ``stats.replicated`` although the holder dropped the replica.
The refusal is counted, logged and kept in ``last_error`` on the holder only.
Nothing decides on that mark (flushing looks at ``PERSISTED`` only, recovery
asks every holder what it actually holds), so a refused replica is never
offered as a source; read ``REPLICATED`` as "sent and acknowledged".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_resiliency.capture.engine import Adopted, adopt_into
from lm_resiliency.capture.layout import Layout
from lm_resiliency.capture.slot import ANONYMOUS, ArenaBacking, Slot, SlotState
from lm_resiliency.checksums import arena_crcs, mismatched
from lm_resiliency.errors import IntegrityError, ReplicationError
from lm_resiliency.knobs import CRC_CHUNK_BYTES
from lm_resiliency.replication import PairingPlan, ReplicationChannel, make_header

log = logging.getLogger(__name__)
_WARN_AFTER_FAILURES = 3
"""Consecutive failed replication cycles after which the failure is logged as a warning."""


@dataclass
class ReplicationStats:
    """Outcome counts and timings of replication cycles on this rank."""

    replicated: int = 0
    """Cycles whose exchange completed here: this rank's capture was sent and acknowledged
    and the replica it received passed its checksums. A holder that refuses this rank's
    capture on its checksums counts that in *its* ``failures``; this count does not see it."""
    failures: int = 0
    last_error: str | None = None
    seconds: list[float] = field(default_factory=list)
    """Each successful cycle, exchange and checksum check of the received replica."""
    verify_s: list[float] = field(default_factory=list)
    """The part of each cycle spent checksumming the received replica (included in ``seconds``)."""
    bytes_sent: int = 0


class PeerReplicas:
    """``peer_current`` / ``peer_previous`` and the channel that fills them."""

    def __init__(
        self,
        channel: ReplicationChannel,
        plan: PairingPlan,
        *,
        rank: int,
        run_id: str,
        pin_memory: bool,
        backing: ArenaBacking = ANONYMOUS,
    ) -> None:
        self.channel = channel
        self.plan = plan
        self.rank = rank
        self.run_id = run_id
        self.pin_memory = pin_memory
        self.slots = [Slot("peer_0", backing=backing), Slot("peer_1", backing=backing)]
        self.stats = ReplicationStats()
        self._failed_in_a_row = 0

    @property
    def current(self) -> Slot:
        return self.slots[0]

    @property
    def previous(self) -> Slot:
        return self.slots[1]

    @property
    def send_to(self) -> int:
        return self.plan.send_to(self.rank)

    @property
    def recv_from(self) -> int:
        return self.plan.recv_from(self.rank)

    def adopt(self, adopted: list[Adopted]) -> None:
        """Take over replicas an earlier process held (newest step into ``peer_current``)."""
        self.slots = adopt_into(self.slots, adopted, owner_rank=self.recv_from)

    def complete_slots(self) -> list[Slot]:
        done = [s for s in self.slots if s.complete and s.step is not None]
        return sorted(done, key=lambda s: s.step or 0, reverse=True)

    def replicate(self, own: Slot) -> bool:
        """Exchange ``own`` (complete) with the partners; True when the replica pair is aligned."""
        assert own.step is not None and own.layout is not None and own.arena is not None
        assert own.document is not None
        step = own.step
        if self.current.complete:
            self.slots.reverse()  # newest complete replica becomes peer_previous
        target = self.current
        target.invalidate()

        def alloc(header: dict[str, Any]) -> torch.Tensor:
            target.prepare(Layout.from_json(header["layout"]), pin=self.pin_memory)
            assert target.arena is not None
            return target.arena

        header = make_header(self.run_id, self.rank, step, own.layout, own.document)
        if own.crcs is not None:
            header[_CRC_KEY] = {"chunk_bytes": CRC_CHUNK_BYTES, "crcs": list(own.crcs)}
        t0 = time.perf_counter()
        try:
            received = self.channel.exchange(
                step=step, send_header=header, send_arena=own.arena, recv_alloc=alloc
            )
            t1 = time.perf_counter()
            crcs = _verified_crcs(received.header, target, src=self.recv_from, step=step)
            self.stats.verify_s.append(time.perf_counter() - t1)
        except (ReplicationError, IntegrityError) as exc:
            target.invalidate()
            self.stats.failures += 1
            self.stats.last_error = str(exc)
            self._failed_in_a_row += 1
            # One missed cycle (a peer restarting or leaving) is routine: the previous
            # replica stays the recovery copy. Cycles that keep failing are a problem.
            repeated = self._failed_in_a_row >= _WARN_AFTER_FAILURES
            log.log(
                logging.WARNING if repeated else logging.INFO,
                "rank %d: step %d was not replicated (%d cycle(s) in a row; sends to rank %d, "
                "receives from rank %d); the previous replica stays the recovery copy: %s",
                self.rank,
                step,
                self._failed_in_a_row,
                self.send_to,
                self.recv_from,
                exc,
            )
            return False
        self._failed_in_a_row = 0
        target.publish(received.step, received.state_document, received.owner_rank, crcs=crcs)
        own.advance(SlotState.REPLICATED)
        self.stats.replicated += 1
        self.stats.bytes_sent += own.layout.total_bytes
        self.stats.seconds.append(time.perf_counter() - t0)
        return True

    def close(self) -> None:
        self.channel.close()
        for s in self.slots:
            s.free()


_CRC_KEY = "slot_crc32c"
"""Header field: ``{"chunk_bytes": n, "crcs": [...]}``, the owner's checksums of its slot."""


def _verified_crcs(header: dict[str, Any], target: Slot, *, src: int, step: int) -> tuple[int, ...]:
    """The checksums of the replica in ``target``, after checking them against the owner's.

    Raises ``IntegrityError`` when the header carries none or a chunk differs.
    """
    assert target.arena is not None
    meta = header.get(_CRC_KEY)
    ok = (
        isinstance(meta, dict)
        and meta.get("chunk_bytes") == CRC_CHUNK_BYTES
        and isinstance(meta.get("crcs"), list)
        and all(isinstance(c, int) and not isinstance(c, bool) for c in meta["crcs"])
    )
    if not ok:
        raise IntegrityError(
            f"replica of step {step} from rank {src} carries no usable checksums "
            f"(header field {_CRC_KEY!r}); it is refused"
        )
    assert isinstance(meta, dict)
    actual = arena_crcs(target.arena)
    expected = list(meta["crcs"])
    if len(expected) != len(actual):
        raise IntegrityError(
            f"replica of step {step} from rank {src}: {len(expected)} checksums for "
            f"{len(actual)} chunks; it is refused"
        )
    bad = mismatched(list(actual), expected)
    if bad:
        raise IntegrityError(
            f"replica of step {step} from rank {src}: chunk(s) {bad[:8]} of {len(actual)} "
            "do not match the owner's CRC-32C (damaged in transit); it is refused"
        )
    return actual

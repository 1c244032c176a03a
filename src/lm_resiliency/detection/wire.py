"""SCOUT's collectives: the replay spec broadcast and the job-wide report exchange.

Both run on private CPU Gloo groups that SCOUT creates (so they work beside an
NCCL training group and never interleave with the training's collectives):

* ``send_spec``: the comparison group's source peer sends the replay spec (a
  JSON document) to its group in one fixed-size ``uint8`` broadcast that runs in
  the background (a spec longer than :data:`SPEC_BYTES` sends its rest in a
  second, synchronous broadcast);
* ``gather_reports``: every rank's fixed-size :class:`RankReport` (144 bytes)
  is all-gathered over the whole job. Every rank then evaluates every group from
  the same bytes, so this single exchange is also the job-wide agreement
  (cycle complete? SDC in any group?) that precedes any save, promotion or
  rejection.

No pickle: specs are JSON, reports are ``struct``-packed.
"""

from __future__ import annotations

import contextlib
import enum
import json
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.errors import ResiliencyError

_MAGIC = b"SCT1"
_HEAD = struct.Struct("<4sQqQB7x")
_CLASS = struct.Struct("<BxxxiiQQd")
CLASSES = ("dense", "optimizer", "dynamic")
REPORT_BYTES = _HEAD.size + _CLASS.size * len(CLASSES)


class RunState(enum.IntEnum):
    """What one recipe class did on a rank in one check."""

    NOT_RUN = 0
    OK = 1
    ERROR = 2
    NO_SIGNATURE = 3


@dataclass(frozen=True)
class ClassReport:
    """One class's outcome on one rank: the recipe, its signature key hash, digest, time."""

    state: RunState = RunState.NOT_RUN
    recipe: int = -1
    extra: int = 0
    """The catalog size K for the dynamic class (0 otherwise)."""
    signature: int = 0
    digest: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RankReport:
    """Everything one rank tells the job about one check (fixed size on the wire)."""

    seq: int
    step: int
    fingerprint: int
    latched: bool
    classes: tuple[ClassReport, ClassReport, ClassReport]

    def pack(self) -> bytes:
        head = _HEAD.pack(_MAGIC, self.seq, self.step, self.fingerprint, int(self.latched))
        body = b"".join(
            _CLASS.pack(c.state, c.recipe, c.extra, c.signature, c.digest, c.seconds)
            for c in self.classes
        )
        return head + body

    @classmethod
    def unpack(cls, raw: bytes) -> RankReport:
        magic, seq, step, fp, latched = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC:
            raise ResiliencyError(f"SCOUT report with magic {magic!r}; peers run another version")
        classes = []
        for i in range(len(CLASSES)):
            st, recipe, extra, sig, dig, sec = _CLASS.unpack_from(raw, _HEAD.size + i * _CLASS.size)
            classes.append(ClassReport(RunState(st), recipe, extra, sig, dig, sec))
        return cls(seq, step, fp, bool(latched), (classes[0], classes[1], classes[2]))

    def of(self, name: str) -> ClassReport:
        return self.classes[CLASSES.index(name)]


#: Bytes of the fixed spec broadcast; a longer spec sends the rest in a second broadcast.
SPEC_BYTES = 4096


class PendingSpec:
    """A spec broadcast in flight (started with :meth:`Channel.send_spec`)."""

    def __init__(
        self, channel: Channel, buf: torch.Tensor, work: Any, overflow: bytes | None
    ) -> None:
        self._channel, self._buf, self._work, self._overflow = channel, buf, work, overflow
        self._doc: dict[str, Any] | None = None

    def result(self) -> dict[str, Any]:
        """Collective (in the group) only when the spec overflowed; the decoded JSON."""
        if self._doc is not None:
            return self._doc
        self._work.wait()
        self._channel.bytes_exchanged += SPEC_BYTES  # counted for the check that uses it
        raw = bytes(self._buf.numpy().tobytes())
        (n,) = struct.unpack_from("<I", raw, 0)
        body = raw[4 : 4 + min(n, SPEC_BYTES - 4)]
        if n > SPEC_BYTES - 4:
            rest = n - (SPEC_BYTES - 4)
            if self._overflow is not None:
                extra = torch.frombuffer(bytearray(self._overflow), dtype=torch.uint8)
            else:
                extra = torch.empty(rest, dtype=torch.uint8)
            ch = self._channel
            dist.broadcast(extra, src=ch.source, group=ch.group)
            ch.bytes_exchanged += rest
            body += bytes(extra.numpy().tobytes())
        self._doc = json.loads(body.decode())
        return self._doc


class Channel:
    """SCOUT's private Gloo groups of one rank. Construct on every rank (collective)."""

    def __init__(self, groups: ComparisonGroups, *, rank: int, timeout_s: float) -> None:
        self.groups = groups
        self.rank = rank
        timeout = timedelta(seconds=timeout_s)
        self.world = dist.new_group(backend="gloo", timeout=timeout)
        self.group_ranks = groups.group_of(rank)
        self.source = groups.source_of(rank)
        if len(groups.groups) == 1:
            self.group = self.world
        else:
            mine = None
            for ranks in groups.groups:  # every rank creates every group, in the same order
                pg = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
                if rank in ranks:
                    mine = pg
            assert mine is not None
            self.group = mine
        self.bytes_exchanged = 0

    def send_spec(self, doc: dict[str, Any] | None) -> PendingSpec:
        """Collective in the comparison group: start broadcasting the source's ``doc``.

        Returns at once (the broadcast runs on Gloo's threads); ``result()`` on the
        returned handle gives the spec on every member.
        """
        is_source = self.rank == self.source
        buf = torch.zeros(SPEC_BYTES, dtype=torch.uint8)
        overflow = None
        if is_source:
            if doc is None:
                raise ResiliencyError("the source peer must provide a spec to broadcast")
            text = json.dumps(doc, separators=(",", ":")).encode()
            head = struct.pack("<I", len(text)) + text[: SPEC_BYTES - 4]
            buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            overflow = text[SPEC_BYTES - 4 :] or None
        work = dist.broadcast(buf, src=self.source, group=self.group, async_op=True)
        return PendingSpec(self, buf, work, overflow)

    def gather_reports(self, report: RankReport) -> list[RankReport]:
        """Collective over the whole job: every rank's report, in rank order."""
        raw = report.pack()
        mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        world = dist.get_world_size(self.world)
        out = [torch.empty(len(raw), dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, mine, group=self.world)
        self.bytes_exchanged += len(raw) * world
        return [RankReport.unpack(bytes(t.numpy().tobytes())) for t in out]

    def gather_u64(self, values: list[int]) -> list[list[int]]:
        """Collective over the job: every rank's list of unsigned 64-bit values (same length)."""
        mine = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values])
        world = dist.get_world_size(self.world)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=self.world)
        return [[int(v) % (1 << 64) for v in t.tolist()] for t in out]

    def close(self) -> None:
        groups = {id(self.world): self.world, id(self.group): self.group}
        for pg in groups.values():
            with contextlib.suppress(Exception):  # gone with the default group already
                dist.destroy_process_group(pg)

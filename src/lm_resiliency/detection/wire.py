"""SCOUT's collectives: the spec broadcast, the group's report exchange, the job's flags.

All run on private CPU Gloo groups that SCOUT creates (so they work beside an
NCCL training group and never interleave with the training's collectives):

* ``send_spec``: the comparison group's source peer sends the replay spec (a
  JSON document) to its group in one fixed-size ``uint8`` broadcast that runs in
  the background (a spec longer than :data:`SPEC_BYTES` sends its rest in a
  second, synchronous broadcast);
* ``post_reports``: every rank's fixed-size :class:`RankReport` (144 bytes) is
  all-gathered inside its **comparison group** only, asynchronously (resolved
  with :meth:`PendingReports.result`). Every member judges its group from the
  same bytes;
* ``agree``: the job-wide agreement (SDC anywhere? every group's cycle done?
  the recipe coverage's minimum?) is one all-reduce (max) of
  :data:`FLAG_WORDS` int64 words over the whole job: O(1) bytes per rank,
  whatever the world size.

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


class PendingReports:
    """A group's report all-gather in flight (started with :meth:`Channel.post_reports`)."""

    def __init__(self, ranks: tuple[int, ...], out: list[torch.Tensor], work: Any) -> None:
        self._ranks, self._out, self._work = ranks, out, work
        self._done: dict[int, RankReport] | None = None

    def result(self) -> dict[int, RankReport]:
        """Wait for the all-gather; the reports by global rank (idempotent)."""
        if self._done is None:
            self._work.wait()
            self._done = {
                r: RankReport.unpack(bytes(t.numpy().tobytes()))
                for r, t in zip(self._ranks, self._out, strict=True)
            }
        return self._done


class PendingMax:
    """A job-wide all-reduce (max) in flight (started with :meth:`Channel.post_agree`)."""

    def __init__(self, t: torch.Tensor, work: Any) -> None:
        self._t, self._work = t, work
        self._done: list[int] | None = None

    def result(self) -> list[int]:
        if self._done is None:
            self._work.wait()
            self._done = [int(v) for v in self._t.tolist()]
        return self._done


#: Words of the job-wide flags all-reduce (see :class:`Flags`).
FLAG_WORDS = 15
_BIG = 1 << 62


def encode_step(value: float) -> int:
    """A step or ``+-inf`` as an int64 that orders the same way."""
    if value == float("inf"):
        return _BIG
    if value == float("-inf"):
        return -_BIG
    return int(value)


def decode_step(value: int) -> float:
    return float("inf") if value >= _BIG else float("-inf") if value <= -_BIG else float(value)


@dataclass(frozen=True)
class Flags:
    """What the whole job agrees on after each check round, from every rank's group.

    Reduced by maximum, so "any" flags are 0/1 and minima travel negated.
    ``frontier``: the minimum over the groups of the newest step every recipe was
    checked clean at or after; ``cycle_done``: every group completed its dynamic
    cycle; ``nondeterministic``/``unreplayable``: the dense block (index) found
    not reproducible / failing on every peer in some group, or -1.
    """

    sdc: bool = False
    inconclusive: bool = False
    anomaly: bool = False
    no_evidence: bool = False
    straggler: bool = False
    cycle_done: bool = True
    frontier: float = float("inf")
    seq: tuple[int, int] = (0, 0)
    step: tuple[int, int] = (0, 0)
    nondeterministic: int = -1
    unreplayable: int = -1
    incomplete: bool = False
    corrupt_group: int = -1
    """The highest index of a comparison group that found SDC or was inconclusive, or -1."""

    def words(self) -> list[int]:
        return [
            int(self.sdc),
            int(self.inconclusive),
            int(self.anomaly),
            int(self.no_evidence),
            int(self.straggler),
            int(not self.cycle_done),
            -encode_step(self.frontier),
            self.seq[1],
            -self.seq[0],
            self.step[1],
            -self.step[0],
            self.nondeterministic,
            self.unreplayable,
            int(self.incomplete),
            self.corrupt_group,
        ]

    @classmethod
    def of_words(cls, w: list[int]) -> Flags:
        return cls(
            sdc=bool(w[0]),
            inconclusive=bool(w[1]),
            anomaly=bool(w[2]),
            no_evidence=bool(w[3]),
            straggler=bool(w[4]),
            cycle_done=not w[5],
            frontier=decode_step(-w[6]),
            seq=(-w[8], w[7]),
            step=(-w[10], w[9]),
            nondeterministic=w[11],
            unreplayable=w[12],
            incomplete=bool(w[13]),
            corrupt_group=w[14],
        )


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

    def post_reports(self, report: RankReport) -> PendingReports:
        """Collective in the comparison group: start all-gathering every member's report.

        Returns at once; :meth:`PendingReports.result` waits and decodes.
        """
        raw = report.pack()
        mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty(len(raw), dtype=torch.uint8) for _ in self.group_ranks]
        # The list form: Gloo runs it on its own threads (the fused one blocks here).
        work = dist.all_gather(out, mine, group=self.group, async_op=True)
        self.bytes_exchanged += len(raw) * len(self.group_ranks)
        return PendingReports(self.group_ranks, out, work)

    def gather_reports(self, report: RankReport) -> dict[int, RankReport]:
        """Collective in the comparison group: every member's report, by global rank."""
        return self.post_reports(report).result()

    def agree(self, flags: list[int]) -> list[int]:
        """Collective over the job: the element-wise maximum of every rank's ``flags``."""
        if len(flags) != FLAG_WORDS:
            raise ResiliencyError(f"SCOUT flags have {len(flags)} words, expected {FLAG_WORDS}")
        return self.agree_max(flags)

    def post_agree(self, flags: list[int]) -> PendingMax:
        """Collective over the job: start :meth:`agree`; ``result()`` gives the maximum."""
        if len(flags) != FLAG_WORDS:
            raise ResiliencyError(f"SCOUT flags have {len(flags)} words, expected {FLAG_WORDS}")
        t = torch.tensor(flags, dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world, async_op=True)
        self.bytes_exchanged += FLAG_WORDS * 8
        return PendingMax(t, work)

    def agree_max(self, values: list[int]) -> list[int]:
        """Collective over the job: the element-wise maximum of every rank's int64 ``values``."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world)
        self.bytes_exchanged += len(values) * 8
        return [int(v) for v in t.tolist()]

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

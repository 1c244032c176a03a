"""Recovery sources: one small protocol, one implementation per place a step can come from.

A :class:`StepSource` says which steps it has (:meth:`~StepSource.steps`),
opens one fully validated (:meth:`~StepSource.open`: nothing is returned that
failed a check) and says whether using it consumes it (own memory is handed
over to the caller without a copy, so it is taken only after the whole
recovery succeeded, the state applied included: see
``InMemoryCheckpointManager.commit_restore``). The manager builds one per place:

===============  ==================================================  =========
source           what                                                consumes
===============  ==================================================  =========
own memory       this rank's complete own slots (this process's, or  yes
                 re-attached from the memory folder)
own disk         this rank's node-local shards                       no
serve memory     what this rank holds for its peer (held slots; in   no
                 HSDP mode its own slots: the replica's shard is
                 identical)
serve disk       the peer's shards on this node (HSDP: our own)      no
===============  ==================================================  =========

The collective choice (:mod:`lm_resiliency.recovery.fetch`) only talks to
this protocol, so a new source plugs in without touching it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lm_resiliency.capture.layout import Layout
from lm_resiliency.capture.slot import Slot
from lm_resiliency.capture.target import Target
from lm_resiliency.persistence.reader import ShardReader
from lm_resiliency.persistence.store import ShardStore
from lm_resiliency.recovery.availability import Source


@dataclass
class Material:
    """A validated state in memory: layout, an arena holding its bytes, its document."""

    layout: Layout
    arena: torch.Tensor
    document: dict[str, Any]
    consume: Callable[[], object] | None = None
    """Hands the slot over (own memory); called once the recovered state was applied."""
    crcs: tuple[int, ...] | None = None
    """The arena's CRC-32C per chunk as recorded when it was filled (memory slots), sent
    with it when it is served to its owner, so damage since then is refused there."""
    filled: bool = False
    """The bytes were read straight into the restore's target (``arena`` is empty)."""


Served = Material | ShardReader
"""What a source opens: a state in memory, or an open, header-validated shard file."""

Eligible = Callable[[int, "str | None"], bool]
"""``(step, timeline)`` -> whether recovery may choose it (see ``recovery.timeline``)."""


class StepSource(Protocol):
    kind: Source
    consumes: bool

    def steps(self) -> frozenset[int]:
        """Steps this source can deliver (listing only; opening may still fail)."""

    def open(self, step: int, target: Target | None = None) -> Served:
        """``step`` validated (raises an error with a ``reason`` when unusable).

        ``target``: live tensors a source may read the bytes into directly, when their
        layout is the step's (the returned material is then ``filled``); after a
        failure their bytes are garbage.
        """


class MemorySlots:
    """Complete slots of a rank (own, or the ones it serves its peer from)."""

    def __init__(
        self,
        kind: Source,
        slots: Callable[[], list[Slot]],
        *,
        eligible: Eligible,
        consumes: bool,
    ) -> None:
        self.kind = kind
        self._slots = slots
        self._eligible = eligible
        self.consumes = consumes

    def steps(self) -> frozenset[int]:
        return frozenset(
            s.step
            for s in self._slots()
            if s.step is not None and self._eligible(s.step, s.timeline)
        )

    def open(self, step: int, target: Target | None = None) -> Material:
        for slot in self._slots():
            if slot.step != step:
                continue
            with slot.reading(step) as s:
                assert s.layout is not None and s.arena is not None and s.document is not None
                assert s.handle is not None
                s.handle.verify()
                consume = functools.partial(s.take, step) if self.consumes else None
                return Material(s.layout, s.arena, s.document, consume, s.crcs)
        raise LookupError(f"no complete slot holds step {step}")


class DiskShards:
    """One owner's node-local shards in this rank's store."""

    def __init__(
        self,
        kind: Source,
        store: Callable[[], ShardStore | None],
        owner: int,
        *,
        eligible: Eligible,
        streamed: bool,
    ) -> None:
        self.kind = kind
        self.consumes = False
        self._store = store
        self.owner = owner
        self._eligible = eligible
        self._streamed = streamed

    def steps(self) -> frozenset[int]:
        store = self._store()
        if store is None:
            return frozenset()
        return frozenset(
            s
            for s in store.steps(self.owner)
            if self._eligible(s, store.timeline_of(self.owner, s))
        )

    def open(self, step: int, target: Target | None = None) -> Served:
        store = self._store()
        if store is None:
            raise LookupError("no node-local folder")
        if self._streamed:
            # Opened and header-checked only: the bytes stream to their owner chunk by
            # chunk, verified there against the checksums stored with them.
            return store.open_reader(owner_rank=self.owner, step=step)
        if target is not None:
            with store.open_reader(owner_rank=self.owner, step=step) as reader:
                if target.matches(reader.layout):
                    reader.read_into_target(target)
                    empty = torch.empty(0, dtype=torch.uint8)
                    return Material(reader.layout, empty, reader.state_document, filled=True)
        shard = store.read(owner_rank=self.owner, step=step)
        return Material(shard.layout, shard.arena, shard.state_document)


class NoSource:
    """A source that has nothing (a rank without a peer, or without a disk)."""

    consumes = False

    def __init__(self, kind: Source) -> None:
        self.kind = kind

    def steps(self) -> frozenset[int]:
        return frozenset()

    def open(self, step: int, target: Target | None = None) -> Served:
        raise LookupError(f"{self.kind.label} has nothing on this rank")

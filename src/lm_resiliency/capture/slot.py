"""Slots: a host arena plus everything needed to rebuild the state it holds.

A slot moves EMPTY -> COPYING -> CAPTURED -> REPLICATED -> PERSISTED. Only a
*complete* slot (CAPTURED or later) is ever replicated, persisted, selected for
recovery or read back; a slot being filled is invisible. Rotation swaps slot
objects between roles, it never copies bytes.

Where the arena lives is the :class:`ArenaBacking`'s business: anonymous
process memory (:class:`AnonymousBacking`, the default, gone with the process)
or a file on a node-local memory filesystem that outlives the process
(:mod:`lm_resiliency.memory`). A backing's :class:`ArenaHandle` is told when
the arena's content is about to change (``begin``), is complete and
checksummed (``commit``, from :meth:`Slot.seal`) or is no longer valid
(``retract``), so a file-backed slot can keep a state word that a restarted
process trusts. A slot is complete in this process from :meth:`Slot.publish`
on; its backing commits it only once :meth:`Slot.seal` gave it the arena's
CRC-32C per chunk (computed off the training thread).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lm_resiliency.capture.arena import allocate_arena
from lm_resiliency.capture.layout import Layout


class SlotState(enum.IntEnum):
    EMPTY = 0
    COPYING = 1
    CAPTURED = 2
    REPLICATED = 3
    """Sent to the peer and acknowledged by its transport (the peer may still refuse the
    bytes on their checksums: informational, no decision rests on it)."""
    PERSISTED = 4


class SlotRole(str, enum.Enum):
    OWN_CURRENT = "own_current"
    OWN_PREVIOUS = "own_previous"
    PEER_CURRENT = "peer_current"
    PEER_PREVIOUS = "peer_previous"


class ArenaHandle(Protocol):
    """One arena of one slot, as its backing keeps it."""

    @property
    def arena(self) -> torch.Tensor:
        """The flat ``uint8`` host buffer."""

    @property
    def survives_process(self) -> bool:
        """Whether the content outlives this process (a restarted worker can re-attach)."""

    def begin(self) -> None:
        """The arena's content is about to change: it must not be trusted until ``commit``."""

    def commit(self, slot: Slot) -> None:
        """The arena holds ``slot``'s complete capture (layout, step, document, owner, crcs)."""

    def retract(self) -> None:
        """The content is no longer valid (a failed capture or receive)."""

    def verify(self) -> None:
        """Check content that outlived an earlier process against its checksums (raise if bad)."""

    def hand_over(self) -> torch.Tensor:
        """Give the arena to a caller; this handle is unusable afterwards."""

    def release(self) -> None:
        """Drop this process's references (a surviving copy stays where it lives)."""

    def discard(self) -> None:
        """Drop the arena everywhere (a surviving copy is removed too)."""


class ArenaBacking(Protocol):
    """Allocates the arenas of slots."""

    def allocate(self, slot_name: str, nbytes: int, *, pin: bool) -> ArenaHandle:
        """A new arena of ``nbytes`` for the slot named ``slot_name``, every page mapped."""


class _AnonymousArena:
    survives_process = False

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena

    def begin(self) -> None:
        pass

    def commit(self, slot: Slot) -> None:
        pass

    def retract(self) -> None:
        pass

    def verify(self) -> None:
        pass

    def hand_over(self) -> torch.Tensor:
        arena, self.arena = self.arena, torch.empty(0, dtype=torch.uint8)
        return arena

    def release(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)

    discard = release


class AnonymousBacking:
    """Process memory: pre-faulted (and page-locked with CUDA and ``pin``) tensors."""

    def allocate(self, slot_name: str, nbytes: int, *, pin: bool) -> ArenaHandle:
        return _AnonymousArena(allocate_arena(nbytes, pin=pin))


ANONYMOUS = AnonymousBacking()


@dataclass
class Slot:
    """One host copy of a state: arena bytes, layout, step, non-tensor document, owner.

    ``readers`` counts background users (e.g. the disk writer) that must finish
    before the arena may be overwritten; use :meth:`reading` to hold it.
    """

    name: str
    backing: ArenaBacking = field(default=ANONYMOUS, repr=False)
    handle: ArenaHandle | None = field(default=None, repr=False)
    layout: Layout | None = None
    step: int | None = None
    document: dict[str, Any] | None = None
    owner_rank: int | None = None
    timeline: str | None = None
    """Timeline of a capture an earlier process left (``None``: captured by this process)."""
    crcs: tuple[int, ...] | None = None
    """CRC-32C per ``CRC_CHUNK_BYTES`` of the arena, once sealed (``None`` until then)."""
    state: SlotState = SlotState.EMPTY
    _readers: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _views: tuple[torch.Tensor, Layout, list[torch.Tensor]] | None = field(
        default=None, repr=False, compare=False
    )
    """The tensor views of the current arena under the current layout (built once)."""

    @property
    def arena(self) -> torch.Tensor | None:
        return None if self.handle is None else self.handle.arena

    @property
    def complete(self) -> bool:
        return self.state >= SlotState.CAPTURED

    @property
    def arena_bytes(self) -> int:
        return 0 if self.handle is None else self.handle.arena.numel()

    def prepare(self, layout: Layout, *, pin: bool) -> bool:
        """Give the arena exactly ``layout.total_bytes`` bytes; True when it was reallocated.

        Waits until no background reader holds the slot, then marks it COPYING
        (and its backing's copy WRITING) so it is invisible until the new
        content is complete.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            self.state = SlotState.COPYING
            self.step = None
            self.timeline = None
            self.crcs = None
        handle = self.handle
        realloc = handle is None or handle.arena.numel() != layout.total_bytes
        if realloc:
            self._views = None
            if handle is not None:
                self.handle = None
                handle.discard()  # free the old arena before the new one is allocated
            handle = self.handle = self.backing.allocate(self.name, layout.total_bytes, pin=pin)
        assert handle is not None
        handle.begin()
        self.layout = layout
        return realloc

    def views(self) -> list[torch.Tensor]:
        """Tensor views of the arena, one per state tensor; reused while arena and layout stay."""
        arena, layout = self.arena, self.layout
        assert arena is not None and layout is not None, f"slot {self.name} is empty"
        cached = self._views
        if cached is not None and cached[0] is arena and cached[1] is layout:
            return cached[2]
        views = layout.views(arena)
        self._views = (arena, layout, views)
        return views

    def publish(
        self,
        step: int,
        document: dict[str, Any],
        owner_rank: int,
        *,
        crcs: tuple[int, ...] | None = None,
    ) -> None:
        """Mark the slot complete for ``step`` (call only after every byte arrived).

        With ``crcs`` (already known, e.g. verified on receipt) it is sealed at
        once; otherwise call :meth:`seal` once they are computed.
        """
        self.step = step
        self.document = document
        self.owner_rank = owner_rank
        assert self.handle is not None
        if crcs is not None:
            self.seal(crcs)
        with self._cond:
            self.state = SlotState.CAPTURED

    def seal(self, crcs: tuple[int, ...] | None) -> None:
        """Record the arena's checksums (``None``: not checksummed) and let the backing
        commit the capture."""
        assert self.handle is not None and self.step is not None
        self.crcs = crcs
        self.handle.commit(self)

    def adopt(
        self,
        handle: ArenaHandle,
        layout: Layout,
        *,
        step: int,
        document: dict[str, Any],
        owner_rank: int,
        timeline: str | None,
        crcs: tuple[int, ...] | None = None,
    ) -> None:
        """Take over a complete capture that outlived an earlier process (already committed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            old, self.handle = self.handle, handle
            self._views = None
            self.layout, self.step, self.document = layout, step, document
            self.owner_rank, self.timeline, self.crcs = owner_rank, timeline, crcs
            self.state = SlotState.CAPTURED
        if old is not None:
            old.release()

    def advance(self, state: SlotState) -> None:
        """Record replication or persistence of a complete slot (never moves backwards)."""
        with self._cond:
            if self.complete and state > self.state:
                self.state = state

    def invalidate(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            self.state = SlotState.EMPTY
            self.step = None
            self.crcs = None
        if self.handle is not None:
            self.handle.retract()

    def free(self) -> None:
        """Forget the arena in this process (a copy that outlives the process stays)."""
        self._forget(discard=False)

    def discard(self) -> None:
        """Forget the arena everywhere (a copy that outlives the process is removed)."""
        self._forget(discard=True)

    def _forget(self, *, discard: bool) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            self.state = SlotState.EMPTY
            self.step = None
            handle, self.handle = self.handle, None
            self._views = None
            self.layout = None
            self.document = None
            self.crcs = None
        if handle is not None:
            handle.discard() if discard else handle.release()

    def take(self, step: int) -> tuple[Layout, torch.Tensor, dict[str, Any]]:
        """Hand the complete capture of ``step`` over to the caller, without copying.

        The slot becomes EMPTY and forgets its arena; its next capture allocates a
        new one (off the training thread). Raises ``LookupError`` when the slot does
        not hold a complete ``step``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            if not self.complete or self.step != step:
                raise LookupError(f"slot {self.name} does not hold a complete step {step}")
            assert self.layout is not None and self.handle is not None
            assert self.document is not None
            layout, document, handle = self.layout, self.document, self.handle
            self.state = SlotState.EMPTY
            self.step = None
            self.handle = None
            self._views = None
            self.layout = None
            self.document = None
        return layout, handle.hand_over(), document

    def hold(self, step: int | None = None) -> None:
        """Take a read guard: the arena is not overwritten, freed or handed over until
        :meth:`unhold`. Raises ``LookupError`` when the slot is not complete (or holds
        another step). Prefer :meth:`reading`; this form is for a guard taken on one
        thread and released on another (a queued disk write)."""
        with self._cond:
            if not self.complete or (step is not None and self.step != step):
                raise LookupError(f"slot {self.name} does not hold a complete step {step}")
            self._readers += 1

    def unhold(self) -> None:
        """Release a guard taken by :meth:`hold`."""
        with self._cond:
            assert self._readers > 0, f"slot {self.name}: unhold() without hold()"
            self._readers -= 1
            self._cond.notify_all()

    @contextmanager
    def reading(self, step: int | None = None) -> Iterator[Slot]:
        """Hold the slot complete (optionally at ``step``) while a background user reads it.

        Raises ``LookupError`` when the slot is not complete (or holds another step).
        """
        self.hold(step)
        try:
            yield self
        finally:
            self.unhold()

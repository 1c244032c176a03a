"""Slots: a host arena plus everything needed to rebuild the state it holds.

A slot moves EMPTY -> COPYING -> CAPTURED -> REPLICATED -> PERSISTED. Only a
*complete* slot (CAPTURED or later) is ever replicated, persisted, selected for
recovery or read back; a slot being filled is invisible. Rotation swaps slot
objects between roles, it never copies bytes.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_resiliency.capture.arena import allocate_arena
from lm_resiliency.capture.layout import Layout


class SlotState(enum.IntEnum):
    EMPTY = 0
    COPYING = 1
    CAPTURED = 2
    REPLICATED = 3
    PERSISTED = 4


class SlotRole(str, enum.Enum):
    OWN_CURRENT = "own_current"
    OWN_PREVIOUS = "own_previous"
    PEER_CURRENT = "peer_current"
    PEER_PREVIOUS = "peer_previous"


@dataclass
class Slot:
    """One host copy of a state: arena bytes, layout, step, non-tensor document, owner.

    ``readers`` counts background users (e.g. the disk writer) that must finish
    before the arena may be overwritten; use :meth:`reading` to hold it.
    """

    name: str
    arena: torch.Tensor | None = None
    layout: Layout | None = None
    step: int | None = None
    document: dict[str, Any] | None = None
    owner_rank: int | None = None
    state: SlotState = SlotState.EMPTY
    _readers: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def complete(self) -> bool:
        return self.state >= SlotState.CAPTURED

    @property
    def arena_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def prepare(self, layout: Layout, *, pin: bool) -> bool:
        """Give the arena exactly ``layout.total_bytes`` bytes; True when it was reallocated.

        Waits until no background reader holds the slot, then marks it COPYING
        so it is invisible until the new content is complete.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            self.state = SlotState.COPYING
            self.step = None
        realloc = self.arena is None or self.arena.numel() != layout.total_bytes
        if realloc:
            self.arena = None  # release the old arena before allocating the new one
            self.arena = allocate_arena(layout.total_bytes, pin=pin)
        self.layout = layout
        return realloc

    def views(self) -> list[torch.Tensor]:
        assert self.arena is not None and self.layout is not None, f"slot {self.name} is empty"
        return self.layout.views(self.arena)

    def publish(self, step: int, document: dict[str, Any], owner_rank: int) -> None:
        """Mark the slot complete for ``step`` (call only after every byte arrived)."""
        with self._cond:
            self.step = step
            self.document = document
            self.owner_rank = owner_rank
            self.state = SlotState.CAPTURED

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

    def free(self) -> None:
        self.invalidate()
        self.arena = None
        self.layout = None
        self.document = None

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
            assert self.layout is not None and self.arena is not None
            assert self.document is not None
            taken = (self.layout, self.arena, self.document)
            self.state = SlotState.EMPTY
            self.step = None
            self.arena = None
            self.layout = None
            self.document = None
            return taken

    @contextmanager
    def reading(self, step: int | None = None) -> Iterator[Slot]:
        """Hold the slot complete (optionally at ``step``) while a background user reads it.

        Raises ``LookupError`` when the slot is not complete (or holds another step).
        """
        with self._cond:
            if not self.complete or (step is not None and self.step != step):
                raise LookupError(f"slot {self.name} does not hold a complete step {step}")
            self._readers += 1
        try:
            yield self
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

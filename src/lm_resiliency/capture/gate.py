"""A commit gate: a capture whose bytes are copied but whose commit waits for a verdict.

SCOUT's pipelined verdict (docs/scout.md, "One check") lets a capture start
before the check's exchange resolved. The capture worker copies the bytes,
releases the caller (``wait_captured`` returns: the sources may change), then
waits on the gate: :meth:`CommitGate.decide` ``True`` publishes and seals the
slot as usual; ``False`` discards it. Until then the slot is never visible to
recovery (not published, no commit record on the memory filesystem), so an SDC
found late still skips the capture, and a process killed meanwhile recovers the
previous committed step.

``resolve`` is the verdict's owner (SCOUT's ``Scout.resolve``, collective): the
engine calls it on the caller's thread from every wait that needs the held
cycle to finish (the next ``capture``, ``wait_idle``), so no call order can
wait on a gate that nobody will decide. ``close`` and the exit path decide
``False`` without resolving (a held capture is dropped, never half-committed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["CommitGate"]


class CommitGate:
    """The commit decision of one held capture at ``step``; decided exactly once."""

    def __init__(self, step: int, resolve: Callable[[], object]) -> None:
        self.step = step
        self._resolve = resolve
        self._decided = threading.Event()
        self.accepted: bool | None = None
        """``True``: commit; ``False``: discard; ``None``: not decided yet."""
        self.reason = ""
        self._listeners: list[Callable[[bool], object]] = []

    @property
    def decided(self) -> bool:
        return self._decided.is_set()

    def on_decided(self, listener: Callable[[bool], object]) -> None:
        """Call ``listener(accepted)`` once decided (at once if it is); keep it trivial.

        It runs on the deciding thread (the caller's, or the exit path's).
        """
        if self._decided.is_set():
            listener(bool(self.accepted))
        else:
            self._listeners.append(listener)

    def decide(self, accepted: bool, reason: str = "") -> None:
        """Set the verdict (the first decision wins; later ones are ignored)."""
        if self._decided.is_set():
            return
        self.accepted, self.reason = accepted, reason
        self._decided.set()
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(accepted)

    def resolve(self) -> None:
        """Caller's thread: have the owner decide now (collective for SCOUT); idempotent.

        If the owner returns or raises without deciding, the capture is discarded
        (and the error propagates).
        """
        if self._decided.is_set():
            return
        try:
            self._resolve()
        finally:
            if not self._decided.is_set():
                self.decide(False, "the verdict was resolved without a decision on this capture")

    def wait(self, timeout_s: float) -> bool:
        """Worker: wait up to ``timeout_s`` for the decision; True once decided."""
        return self._decided.wait(timeout_s)

"""Small shims for Python 3.10, the oldest supported version (a leaf module, no imports)."""

from __future__ import annotations

import contextlib


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on 3.11+; on 3.10 the same ``__notes__`` list, kept by hand.

    Never raises: an exception that refuses attributes simply goes without the note.
    """
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
        return
    with contextlib.suppress(AttributeError, TypeError):
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)

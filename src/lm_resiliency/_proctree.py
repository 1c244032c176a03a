"""Process trees on Linux: find every descendant of a process, signal a set of them.

Used by the launcher (``lm-resiliency launch``) and the torchrun test helpers, whose workers run
in their own sessions, so a process group signal does not reach them and the tree has to be
walked through ``/proc``. A leaf module (standard library only).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["alive", "descendants", "die_with_parent", "set_child_subreaper", "signal_all"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        # The command name is parenthesized and may contain spaces; state and ppid follow it.
        fields = text[text.rfind(")") + 2 :].split()
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), zombies included."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    # Give signalled processes a moment to be reaped before callers look again.
    time.sleep(0.05)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_child_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants of this process its children (Linux), so a walk finds them.

    Without it, a worker whose parent died is re-parented to init and escapes
    :func:`descendants`. ``on=False`` clears it again (a launcher run inside a longer-lived
    process, such as a test run, gives the flag back). Returns False where the kernel does not
    support it.
    """
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0)


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child between fork and exec: get ``sig`` when the parent dies (Linux, best effort)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))

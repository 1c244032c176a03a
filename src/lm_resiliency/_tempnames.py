"""Temporary file names that carry their writer's ownership scope.

A temp name says what it will become and who wrote it: the kernel boot id, the
PID namespace (inode of ``/proc/self/ns/pid``) and the writer's pid. A temp
whose scope equals ours and whose pid is no longer alive was left by a writer
that died; it is safe to remove. A temp from another boot or PID namespace
(another host sharing the folder, another container, the time before a reboot)
cannot be judged by a local pid check, so it is never touched.

Shared by the checkpoint folder (``persistence.publish``, which also reaps
stale temps) and the memory tier's slot folder (``memory.slotfile``).
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass

from lm_resiliency._safefs import check_name

__all__ = ["TempName", "TempScope", "is_stale", "pid_alive", "temp_name"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PID_NS = "/proc/self/ns/pid"
_UNKNOWN_BOOT = "unknown"
_SEQ = itertools.count()
_TEMP_RE = re.compile(
    r"^\.(?P<target>.+)\.lmr-(?P<boot>[0-9a-f]{32}|unknown)-(?P<ns>\d+)-(?P<pid>\d+)-(?P<seq>\d+)\.tmp$"
)


@dataclass(frozen=True)
class TempScope:
    """Where a pid means something: one boot of one host, one PID namespace.

    ``known`` is false when ``/proc`` does not tell us (not Linux, restricted
    ``/proc``); such a scope never reaps anything, not even its own temps.
    """

    boot_id: str
    pid_namespace: int

    @classmethod
    def current(cls) -> TempScope:
        """The scope of the calling process (read fresh: a fork may change the pid namespace)."""
        try:
            with open(_BOOT_ID, encoding="ascii") as f:
                boot = f.read().strip().replace("-", "").lower()
            if not re.fullmatch(r"[0-9a-f]{32}", boot):
                boot = _UNKNOWN_BOOT
        except OSError:
            boot = _UNKNOWN_BOOT
        try:
            ns = os.stat(_PID_NS).st_ino
        except OSError:
            ns = 0
        return cls(boot_id=boot, pid_namespace=ns)

    @property
    def known(self) -> bool:
        return self.boot_id != _UNKNOWN_BOOT and self.pid_namespace != 0

    @property
    def token(self) -> str:
        return f"{self.boot_id}-{self.pid_namespace}"


@dataclass(frozen=True)
class TempName:
    """A parsed temp file name: what it will become and who wrote it."""

    target: str
    scope: TempScope
    pid: int
    seq: int

    @classmethod
    def parse(cls, name: str) -> TempName | None:
        """The parts of a temp name written by :func:`temp_name`, or ``None`` for any other name."""
        m = _TEMP_RE.match(name)
        if m is None:
            return None
        return cls(
            target=m["target"],
            scope=TempScope(m["boot"], int(m["ns"])),
            pid=int(m["pid"]),
            seq=int(m["seq"]),
        )


def temp_name(target: str, scope: TempScope | None = None) -> str:
    """A fresh hidden temp name for ``target`` owned by this process (unique per call)."""
    scope = scope or TempScope.current()
    return f".{check_name(target)}.lmr-{scope.token}-{os.getpid()}-{next(_SEQ)}.tmp"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process in our PID namespace (unknown counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive but not ours to signal
        return True
    return True


def is_stale(temp: TempName, scope: TempScope) -> bool:
    """A temp of ``scope`` whose writer is dead (never true for another scope)."""
    if not scope.known or temp.scope != scope:
        return False
    return temp.pid != os.getpid() and not pid_alive(temp.pid)

"""Atomic publication of a file, and the ownership scope of temporary files.

A file becomes visible only complete: it is written to a temp file in the same
directory, flushed and fsynced, atomically renamed over its final name, and the
directory is fsynced so the rename itself survives a crash.

Temp names carry their writer's *ownership scope*: the kernel boot id, the PID
namespace (inode of ``/proc/self/ns/pid``) and the writer's pid. A temp whose
scope equals ours and whose pid is no longer alive was left by a writer that
died; it is safe to remove. A temp from another boot or PID namespace (another
host sharing the folder, another container, the time before a reboot) cannot
be judged by a local pid check, so it is never touched.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from lm_resiliency.persistence._safefs import FILE_MODE, check_name, entry_kind, open_file_nofollow

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


def reap_stale_temps(dir_fd: int, *, target: str | None = None) -> int:
    """Remove temps in ``dir_fd`` left by dead writers of our scope; return how many.

    With ``target`` only temps of that final name are considered. Temps of
    other scopes, of live pids and of this process are left alone. Unlinking
    never follows a link, so a planted symlink with a temp name is harmless.
    """
    scope = TempScope.current()
    removed = 0
    for name in os.listdir(dir_fd):
        temp = TempName.parse(name)
        if temp is None or (target is not None and temp.target != target):
            continue
        if not is_stale(temp, scope) or entry_kind(dir_fd, name) not in ("file", "symlink"):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
            removed += 1
    if removed:
        os.fsync(dir_fd)
    return removed


@dataclass(frozen=True)
class Recycled:
    """An existing file (a retired generation) to overwrite in place instead of a new file."""

    dir_fd: int
    name: str


def publish(
    dir_fd: int,
    final_name: str,
    write: Callable[[int], int],
    *,
    recycle: Recycled | None = None,
) -> None:
    """Atomically create or replace ``final_name`` in ``dir_fd`` with what ``write`` writes.

    ``write(fd)`` writes the whole content from offset 0 and returns its size
    in bytes. With ``recycle``, that file is first renamed to our temp name and
    overwritten in place (then truncated to the size), which skips the block
    allocation of a new file. On any failure the temp is removed and the error
    re-raised; the final name then still shows its previous content, if any.
    """
    check_name(final_name)
    tmp = temp_name(final_name)
    flags = os.O_WRONLY
    if recycle is not None:
        os.rename(recycle.name, tmp, src_dir_fd=recycle.dir_fd, dst_dir_fd=dir_fd)
    else:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = open_file_nofollow(dir_fd, tmp, flags, where=tmp, mode=FILE_MODE)
        try:
            size = write(fd)
            if recycle is not None:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def publish_bytes(dir_fd: int, final_name: str, data: bytes) -> None:
    """:func:`publish` for a small in-memory payload (sidecars, manifests)."""

    def _write(fd: int) -> int:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        return len(data)

    publish(dir_fd, final_name, _write)

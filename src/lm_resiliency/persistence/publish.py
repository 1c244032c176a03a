"""Atomic publication of a file, and the ownership scope of temporary files.

A file becomes visible only complete: it is written to a temp file in the same
directory, flushed and fsynced, atomically renamed over its final name, and the
directory is fsynced so the rename itself survives a crash.

Temp names carry their writer's *ownership scope* (:mod:`lm_resiliency._tempnames`):
a temp whose scope equals ours and whose pid is no longer alive was left by a
writer that died and is removed by :func:`reap_stale_temps`; a temp from another
boot or PID namespace is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from lm_resiliency._safefs import (
    FILE_MODE,
    check_file_fd,
    check_name,
    entry_kind,
    open_file_nofollow,
)
from lm_resiliency._tempnames import TempName, TempScope, is_stale, temp_name
from lm_resiliency.errors import UnsafePathError

log = logging.getLogger(__name__)


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
    """An existing file (a retired generation) to overwrite in place instead of a new file.

    ``identity`` is the ``(st_dev, st_ino)`` recorded when it was set aside.
    """

    dir_fd: int
    name: str
    identity: tuple[int, int]


def _open_recycled(dir_fd: int, tmp: str, recycle: Recycled) -> int | None:
    """Rename the spare to ``tmp`` and open it for overwriting, if it is still ours alone.

    ``None`` (our link removed, nothing written) when it is no longer the file
    we parked, has gained a hard link, or is not a regular file of ours.
    Raises ``FileNotFoundError`` when the spare is gone.
    """
    os.rename(recycle.name, tmp, src_dir_fd=recycle.dir_fd, dst_dir_fd=dir_fd)
    fd = None
    try:
        fd = open_file_nofollow(dir_fd, tmp, os.O_WRONLY, where=tmp)
        check_file_fd(fd, tmp, sole_link=True, identity=recycle.identity)
    except (UnsafePathError, FileNotFoundError) as exc:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)  # drops only our link: the other one is untouched
        log.info("not overwriting spare %s (%s); writing a new file", recycle.name, exc)
        return None
    except BaseException:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return fd


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
    allocation of a new file - but only after its descriptor proved it is the
    file that was set aside (same device and inode), a regular file of ours
    with a single link; otherwise our link to it is removed and a new file is
    written. Nothing else is ever written in place. On any failure the temp is
    removed and the error re-raised; the final name then still shows its
    previous content, if any. Raises ``FileNotFoundError`` when the spare to
    recycle has vanished (nothing written).
    """
    check_name(final_name)
    tmp = temp_name(final_name)
    fd = _open_recycled(dir_fd, tmp, recycle) if recycle is not None else None
    in_place = fd is not None
    try:
        if fd is None:
            fd = open_file_nofollow(
                dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, where=tmp, mode=FILE_MODE
            )
        try:
            size = write(fd)
            if in_place:
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

"""The per-rank ownership lock of a run's node-local disk namespace.

::

    <disk_folder>/run-<sha256(run_id)[:16]>/live-rank-<R>.lock   (flock'ed by the live process)

A manager takes the lock of its rank once it uses the disk tier (its run's
namespace exists at start, or it persists its first step) and holds it until
``close`` or its death (the kernel releases a ``flock`` with the process). A
second live job with the same run id and folder on the same node is refused
with an error naming the holder (pid, host), instead of both jobs writing and
recovering each other's generations. The file holds one JSON line
``{"pid": ..., "host": ...}`` of the holder; ``lm-resiliency clean`` treats a
namespace whose lock is held as live (:func:`held_locks`).

Call order (one rank, not collective)::

    lock = DiskLock.take(root, run_id=..., rank=...)   # waits briefly for an exiting owner
    ...
    lock.release()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
from pathlib import Path

from lm_resiliency._safefs import flock_within, opened_dir
from lm_resiliency.errors import ResiliencyError, UnsafePathError
from lm_resiliency.knobs import MEMORY_LOCK_WAIT_S
from lm_resiliency.persistence import namespace as ns

LOCK_RE = re.compile(r"live-rank-(0|[1-9][0-9]{0,9})\.lock")


def lock_file(rank: int) -> str:
    """Name of rank ``rank``'s lock file in the run's namespace folder."""
    return f"live-rank-{rank}.lock"


def _holder(fd: int) -> str:
    raw = os.pread(fd, 256, 0).decode(errors="replace").strip()
    try:
        doc = json.loads(raw)
        return f"pid {doc['pid']} on host {doc['host']}"
    except (ValueError, KeyError, TypeError):
        return f"holder {raw[:80]!r}" if raw else "an unknown process"


class DiskLock:
    """A held lock of one rank of one run under one disk folder."""

    def __init__(self, fd: int, where: str) -> None:
        self._fd: int | None = fd
        self.where = where

    @classmethod
    def take(
        cls, root: Path, *, run_id: str, rank: int, wait_s: float = MEMORY_LOCK_WAIT_S
    ) -> DiskLock:
        """Lock ``root``'s namespace of ``run_id`` for ``rank`` (the run folder must exist).

        Raises ``ResiliencyError`` naming the holder when another live process keeps
        it beyond ``wait_s``, and ``UnsafePathError`` for a lock entry that is not a
        regular file of ours.
        """
        name = lock_file(rank)
        run = ns.run_dir(run_id)
        where = str(root / run / name)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with opened_dir(root, [run], create=False) as run_fd:
            try:
                fd = os.open(name, flags, 0o600, dir_fd=run_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise UnsafePathError(
                        f"{where} is not a regular file (a link, FIFO or directory): remove it"
                    ) from None
                raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise UnsafePathError(f"{where} must be a regular file owned by this user: remove it")
        try:
            locked = flock_within(fd, wait_s)
        except OSError:
            os.close(fd)
            raise
        if not locked:
            holder = _holder(fd)
            os.close(fd)
            raise ResiliencyError(
                f"disk folder {root}: run {run_id!r} rank {rank} is in use by another "
                f"live job ({holder}; lock {where}). Two jobs must not share a run id "
                "and disk folder: stop the other job, or give this one another "
                "run_id or disk_folder"
            )
        doc = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{doc}\n".encode(), 0)
        return cls(fd, where)

    def release(self) -> None:
        """Unlock (the file stays: removing it would race a new holder)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def held_locks(run_path: Path) -> list[str]:
    """The lock files under the run folder ``run_path`` that a live process holds."""
    held = []
    try:
        names = sorted(os.listdir(run_path))
    except OSError:
        return []
    for name in names:
        if not LOCK_RE.fullmatch(name):
            continue
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(run_path / name, flags)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            held.append(name)
        finally:
            os.close(fd)
    return held

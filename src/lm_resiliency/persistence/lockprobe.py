"""Whether a live process holds a ``flock``-ed lock file, asked without taking part.

The memory tier's rank folders (``lock``) and the disk namespace are owned by
the live process that holds a lock file in them; the kernel releases the lock
when that process dies. Tools that judge or remove such folders
(``lm-resiliency inspect`` and ``clean``) ask here. The probe opens the entry
read-only, without following a link and without blocking, and tries a
non-blocking exclusive ``flock`` that it releases at once. Anything it cannot
judge (a lock that is not a regular file, or that this user cannot open) is an
:class:`UnknownLock`: a caller that removes things must treat it as held.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnknownLock(Exception):
    """The lock entry cannot be judged; the message names it and why (one line)."""


def lock_is_held(dir_fd: int, name: str, *, where: str) -> bool | None:
    """``True`` when a live process holds lock ``name`` of ``dir_fd``, ``False`` when
    nobody does, ``None`` when there is no such entry.

    ``where`` is the entry's path for messages. Raises :class:`UnknownLock` for a
    symlink, a FIFO, a directory or any other non-regular entry, or one that
    cannot be opened or locked (another user's private file).
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UnknownLock(
            f"{where} is not a regular file (mode {st.st_mode:o}); a live process may use the "
            "folder, so it is kept. Remove the entry by hand once no job runs there"
        )
    try:
        fd = os.open(name, _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnknownLock(
            f"{where} cannot be opened to ask whether a live process holds it ({exc.strerror}); "
            "run this as the job's user"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise UnknownLock(f"{where} cannot be locked ({exc.strerror})") from None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def holder_pid(dir_fd: int, name: str) -> str:
    """The pid a lock file names (its holder writes it there), or ``"?"``."""
    try:
        fd = os.open(name, _FLAGS, dir_fd=dir_fd)
    except OSError:
        return "?"
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return text if text.isdigit() else "?"


def take_lock(dir_fd: int, name: str, *, where: str) -> int | None:
    """Hold lock ``name`` of ``dir_fd`` (its descriptor; close it to release), or ``None``
    when a live process holds it. A process that starts meanwhile waits for it.

    Raises :class:`UnknownLock` like :func:`lock_is_held`, and ``FileNotFoundError``.
    """
    if lock_is_held(dir_fd, name, where=where) is None:
        raise FileNotFoundError(where)
    fd = os.open(name, _FLAGS, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise UnknownLock(f"{where} cannot be locked ({exc.strerror})") from None
    return fd

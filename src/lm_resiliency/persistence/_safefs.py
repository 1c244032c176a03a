"""Walking the checkpoint folder without ever following a symlink.

Every directory below the (resolved) checkpoint root is opened relative to its
parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``, and every file with
``O_NOFOLLOW``, so a symlink planted anywhere inside the folder - in place of
a run, topology or step directory, or of a shard - is refused instead of
leading reads or writes elsewhere. Working on descriptors (``openat``-style)
also closes the window between a check and the use of a path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from lm_resiliency.errors import UnsafePathError

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_name(name: str) -> str:
    """Return ``name`` if it is one plain path component (programmer error otherwise)."""
    assert name and name not in (".", "..") and "/" not in name and "\0" not in name, name
    return name


def entry_kind(dir_fd: int, name: str) -> str | None:
    """``"file"``, ``"dir"``, ``"symlink"``, ``"other"`` or ``None`` (absent), never following."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "other"


def _refuse(dir_fd: int, name: str, where: str, exc: OSError) -> UnsafePathError:
    kind = entry_kind(dir_fd, name)
    what = "a symlink" if kind == "symlink" else f"not what was expected ({kind or exc.strerror})"
    return UnsafePathError(
        f"{where} is {what}; lm-resiliency never follows links inside the checkpoint folder. "
        "Remove it (or point disk_folder at a directory the training job owns)."
    )


def open_subdir(dir_fd: int, name: str, *, create: bool, where: str) -> int:
    """Open directory ``name`` under ``dir_fd`` (creating it 0o700 when ``create``).

    Raises ``FileNotFoundError`` when absent and ``create`` is false, and
    ``UnsafePathError`` when the entry is a symlink or not a directory.
    """
    check_name(name)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(dir_fd, name, where, exc) from None
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        # The new entry must survive a crash before anything inside it counts.
        os.fsync(dir_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(dir_fd, name, where, exc) from None
        raise


def open_root(root: Path) -> int:
    """Open the resolved checkpoint root (the caller resolved any links above it)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


@contextlib.contextmanager
def opened_dir(root: Path, parts: Sequence[str], *, create: bool) -> Iterator[int]:
    """Descriptor of ``root/parts...``, each level opened without following links.

    Raises ``FileNotFoundError`` (a level is absent and ``create`` is false) or
    ``UnsafePathError``. The descriptor is closed on exit.
    """
    fd = open_root(root)
    try:
        where = root
        for part in parts:
            where = where / part
            child = open_subdir(fd, part, create=create, where=str(where))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def open_file_nofollow(dir_fd: int, name: str, flags: int, *, where: str) -> int:
    """Open an existing regular file without following a link; refuse anything else."""
    check_name(name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(dir_fd, name, where, exc) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{where} is not a regular file; refusing to read or replace it")
    return fd


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` at the current offset (``os.write`` may be partial)."""
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    """Read exactly ``nbytes`` at ``offset``; fewer only if the file ends first."""
    parts = []
    while nbytes > 0:
        chunk = os.pread(fd, nbytes, offset)
        if not chunk:
            break
        parts.append(chunk)
        nbytes -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def preadinto_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; returns the bytes read (short only at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done

"""Walking the checkpoint folder safely: no symlinks, no foreign owners, no FIFOs.

Every directory below the (resolved) checkpoint root is opened relative to its
parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``, and every file with
``O_NOFOLLOW``, so a symlink planted anywhere inside the folder - in place of
a run, topology or step directory, or of a shard - is refused instead of
leading reads or writes elsewhere. Working on descriptors (``openat``-style)
also closes the window between a check and the use of a path.

Every descriptor is ``fstat``-ed before it is used:

* a directory must be owned by the user running the job and not writable by
  group or others (:func:`check_dir_fd`); the checkpoint root alone may be a
  shared sticky directory such as ``/tmp`` (mode ``1777``). Otherwise another
  local user could plant, swap or remove what recovery reads.
* a file must be a regular file owned by us and not writable by group or
  others (:func:`check_file_fd`). Files are opened with ``O_NONBLOCK``, so a
  FIFO, device or socket in place of a file is refused at once instead of
  blocking the open.
* a file is overwritten in place only when it is the one we parked (same
  device and inode) and has no other hard link (``sole_link``): writing through
  a second link would change a file outside the checkpoint folder or a
  ``cp -al`` backup of it.

Reusable pieces (also for the shared-memory slot folder): :func:`check_dir_fd`,
:func:`check_file_fd`, :func:`judge`, :func:`open_file_nofollow`,
:func:`open_subdir`, :func:`opened_dir`. They raise
:class:`~lm_resiliency.errors.UnsafePathError` whose ``reason`` is one of
:data:`UNSAFE_REASONS` and whose message names the path, its owner (name and
uid), its mode and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from lm_resiliency.errors import UnsafePathError

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO (or a device) must never wait for a peer; O_NOCTTY:
# a terminal in place of a file must not become our controlling terminal.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

#: ``UnsafePathError.reason`` values.
SYMLINK = "symlink"
NOT_A_DIRECTORY = "not_a_directory"
NOT_A_FILE = "not_a_file"
FOREIGN_OWNER = "foreign_owner"
WRITABLE_BY_OTHERS = "writable_by_others"
HARD_LINKED = "hard_linked"
REPLACED = "replaced"
UNSAFE_REASONS = (
    SYMLINK,
    NOT_A_DIRECTORY,
    NOT_A_FILE,
    FOREIGN_OWNER,
    WRITABLE_BY_OTHERS,
    HARD_LINKED,
    REPLACED,
)


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


# -- describing and judging what a descriptor or entry is ------------------------------


def owner_of(uid: int) -> str:
    """``"alice (uid 1000)"``; ``"uid 1000"`` when the uid has no name here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind_of(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "of an unknown kind"


def _facts(st: os.stat_result) -> str:
    return f"owner {owner_of(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _me() -> str:
    return owner_of(os.geteuid())


def judge(
    st: os.stat_result, where: str, *, expect: Literal["dir", "file"], root: bool = False
) -> UnsafePathError | None:
    """The refusal for an entry whose ``stat`` is ``st``, or ``None`` when it is safe.

    ``expect`` is ``"dir"`` or ``"file"``. A safe directory is owned by the
    effective user and not writable by group or others; ``root=True`` (the
    checkpoint root) also accepts a group/other-writable directory with the
    sticky bit (``/tmp``, ``/dev/shm``), whose entries only their owners can
    remove or rename, whoever owns it. A safe file is a regular file owned by
    the effective user and not writable by group or others.
    """
    mode = st.st_mode
    want_dir = expect == "dir"
    if stat.S_ISLNK(mode):
        return UnsafePathError(
            f"{where} is a symlink; lm-resiliency never follows links inside the checkpoint "
            "folder. Remove it (or point disk_folder at a directory the training job owns)",
            reason=SYMLINK,
            path=where,
        )
    if want_dir != stat.S_ISDIR(mode) or not (want_dir or stat.S_ISREG(mode)):
        what = "directory" if want_dir else "regular file"
        return UnsafePathError(
            f"{where} is {_kind_of(mode)} ({_facts(st)}), not a {what}; refusing to open, read "
            "or replace it. Remove it (it was not written by lm-resiliency)",
            reason=NOT_A_DIRECTORY if want_dir else NOT_A_FILE,
            path=where,
        )
    others_write = mode & _OTHERS_WRITE
    if root:
        if others_write and not mode & stat.S_ISVTX:
            return UnsafePathError(
                f"checkpoint folder {where} ({_facts(st)}) is writable by group or others "
                "without the sticky bit, so another user could replace what recovery loads. "
                f"Fix: chmod go-w {where} (or chmod +t for a shared folder like /tmp), or "
                "choose a disk_folder only the job's user can write (mkdir -m 700 DIR)",
                reason=WRITABLE_BY_OTHERS,
                path=where,
            )
        return None
    what = "directories" if want_dir else "files"
    if st.st_uid != os.geteuid():
        return UnsafePathError(
            f"{where} is owned by {owner_of(st.st_uid)} (mode {stat.S_IMODE(mode):04o}), but "
            f"lm-resiliency only uses {what} owned by the user running the job ({_me()}); "
            "another user may have planted it to swap the state recovery loads. Fix: move it "
            "aside and inspect it, or choose a disk_folder only the job's user can write "
            "(mkdir -m 700 DIR)",
            reason=FOREIGN_OWNER,
            path=where,
        )
    if others_write:
        fix = f"chmod go-w {where}" if want_dir else f"chmod 600 {where}"
        return UnsafePathError(
            f"{where} ({_facts(st)}) is writable by group or others, so another user could "
            f"change or replace what recovery loads. Fix: {fix} (lm-resiliency creates "
            f"{what} {DIR_MODE if want_dir else FILE_MODE:04o})",
            reason=WRITABLE_BY_OTHERS,
            path=where,
        )
    return None


def check_dir_fd(fd: int, where: str, *, root: bool = False) -> os.stat_result:
    """``fstat`` of directory descriptor ``fd`` after checking it is safe to use.

    Call on every directory the library creates or enters (``root=True`` for
    the configured folder itself, e.g. ``disk_folder`` or the memory folder).
    Not collective. Raises ``UnsafePathError`` (reason ``not_a_directory``,
    ``foreign_owner`` or ``writable_by_others``) naming ``where``, its owner,
    its mode and the fix; see :func:`judge`.
    """
    st = os.fstat(fd)
    problem = judge(st, where, expect="dir", root=root)
    if problem is not None:
        raise problem
    return st


def check_file_fd(
    fd: int,
    where: str,
    *,
    sole_link: bool = False,
    identity: tuple[int, int] | None = None,
) -> os.stat_result:
    """``fstat`` of file descriptor ``fd`` after checking it is a regular file of ours.

    ``sole_link=True`` (before overwriting or truncating in place) also
    requires ``st_nlink == 1``; ``identity`` (``(st_dev, st_ino)`` recorded
    when the file was set aside) requires it to be that very file. Raises
    ``UnsafePathError`` with reason ``not_a_file``, ``foreign_owner``,
    ``writable_by_others``, ``hard_linked`` or ``replaced``.
    """
    st = os.fstat(fd)
    problem = judge(st, where, expect="file")
    if problem is not None:
        raise problem
    if identity is not None and (st.st_dev, st.st_ino) != identity:
        raise UnsafePathError(
            f"{where} is not the file lm-resiliency set aside (device/inode "
            f"{st.st_dev}/{st.st_ino}, expected {identity[0]}/{identity[1]}); not overwriting it",
            reason=REPLACED,
            path=where,
        )
    if sole_link and st.st_nlink != 1:
        raise UnsafePathError(
            f"{where} has {st.st_nlink} hard links (a backup made with cp -al or rsync "
            "--link-dest, or a link planted to a file elsewhere); lm-resiliency never "
            "overwrites a file that is linked elsewhere",
            reason=HARD_LINKED,
            path=where,
        )
    return st


# -- opening ---------------------------------------------------------------------------


def _refuse(
    dir_fd: int, name: str, where: str, *, expect: Literal["dir", "file"]
) -> UnsafePathError:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return UnsafePathError(
            f"{where} changed while it was opened; refusing it", reason=REPLACED, path=where
        )
    problem = judge(st, where, expect=expect)
    return problem or UnsafePathError(
        f"{where} could not be opened safely; refusing it", reason=REPLACED, path=where
    )


def _open_dir(dir_fd: int, name: str, where: str) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(dir_fd, name, where, expect="dir") from None
        raise
    try:
        check_dir_fd(fd, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(dir_fd: int, name: str, *, create: bool, where: str) -> int:
    """Open directory ``name`` under ``dir_fd`` (creating it 0o700 when ``create``).

    The descriptor is checked with :func:`check_dir_fd`. Raises
    ``FileNotFoundError`` when absent and ``create`` is false, and
    ``UnsafePathError`` when the entry is a symlink, not a directory, owned by
    another user or writable by group or others.
    """
    check_name(name)
    try:
        return _open_dir(dir_fd, name, where)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        # The new entry must survive a crash before anything inside it counts.
        os.fsync(dir_fd)
    return _open_dir(dir_fd, name, where)


def open_root(root: Path) -> int:
    """Open the resolved checkpoint root (the caller resolved any links above it).

    Checked with :func:`check_dir_fd` (``root=True``): a shared sticky folder
    such as ``/tmp`` is fine, a group/other-writable one without the sticky bit
    raises ``UnsafePathError``.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_dir_fd(fd, str(root), root=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def opened_dir(root: Path, parts: Sequence[str], *, create: bool) -> Iterator[int]:
    """Descriptor of ``root/parts...``, each level opened without following links.

    Every level is checked (:func:`open_root`, :func:`open_subdir`). Raises
    ``FileNotFoundError`` (a level is absent and ``create`` is false) or
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


def open_file_nofollow(
    dir_fd: int, name: str, flags: int, *, where: str, mode: int = FILE_MODE
) -> int:
    """Open file ``name`` of ``dir_fd`` safely and return the (blocking) descriptor.

    Never follows a link and never blocks in ``open``: ``O_NOFOLLOW |
    O_NONBLOCK | O_NOCTTY | O_CLOEXEC`` are added to ``flags`` (``O_NONBLOCK``
    is cleared again once the descriptor is known to be a regular file). With
    ``O_CREAT`` in ``flags`` a new file gets ``mode`` (default 0o600). The
    descriptor is checked with :func:`check_file_fd`. Raises
    ``FileNotFoundError`` when absent (without ``O_CREAT``), ``UnsafePathError``
    for a symlink, FIFO, socket, device, directory, a file owned by another
    user or writable by group or others, and ``OSError`` otherwise.
    """
    check_name(name)
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        # ELOOP: a symlink; ENXIO: a FIFO without reader (write) or a socket; EISDIR,
        # EWOULDBLOCK: a directory or a device that would wait.
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK):
            raise _refuse(dir_fd, name, where, expect="file") from None
        raise
    try:
        check_file_fd(fd, where)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- whole reads and writes ------------------------------------------------------------


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


def flock_within(fd: int, wait_s: float, *, poll_s: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting up to ``wait_s`` for its holder to let
    go (an exiting predecessor); False when it is still held then. Raises ``OSError`` for
    any other failure. The caller owns ``fd`` either way."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)

"""One rank's private directory of slot files on the memory filesystem.

::

    <memory_folder>/run-<sha256(run_id)[:16]>/topo-<sha256(topology)[:16]>/rank-<R>/
        lock                   (flock'ed by the live process that uses the folder)
        own-0.slot own-1.slot  (this rank's own captures)
        held-0.slot held-1.slot (the replicas this rank holds for its peer)

Directory names are those of the node-local disk namespace, so a run and a
topology map to the same names in both tiers. Every directory is created
``0700`` and entered without following links; one that is not ours or is
writable by others is refused; so is a memory folder itself that another user
owns (only a sticky shared folder of root's such as ``/dev/shm`` may hold our
run folders), and a ``lock`` that is anything but a regular file of ours. A
filesystem out of space or inodes while the folders are made raises
:class:`~lm_resiliency.memory.slotfile.MemoryFolderFull`. The ``lock`` file
is held with ``flock`` for the manager's lifetime: the kernel releases it
when the process dies, so a restarted worker takes over at once, while a
second live process using the same rank's folder is refused instead of
tearing its slots.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from lm_resiliency._safefs import FOREIGN_OWNER, NOT_A_FILE, flock_within, open_subdir, owner_of
from lm_resiliency._safefs import open_root as safe_open_root
from lm_resiliency.errors import ConfigError, ResiliencyError, UnsafePathError
from lm_resiliency.knobs import MEMORY_LOCK_WAIT_S
from lm_resiliency.memory.slotfile import (
    SlotFile,
    SlotIdentity,
    SlotRecord,
    SlotUnavailable,
    check_descriptor,
    full_error,
    is_full,
)
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.lineage import Lineage, read_lineage, write_lineage

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
LINEAGE_FILE = "lineage.json"
_SUFFIX = ".slot"


def slot_file_name(slot_name: str) -> str:
    """``own_0`` -> ``own-0.slot``, ``peer_1`` -> ``held-1.slot``."""
    kind, _, index = slot_name.partition("_")
    role = {"own": "own", "peer": "held"}[kind]
    return f"{role}-{index}{_SUFFIX}"


def rank_dir(rank: int) -> str:
    return f"rank-{rank}"


@dataclass(frozen=True)
class Attached:
    """A committed slot file found at start, validated (all but its data checksums)."""

    slot_name: str
    file: SlotFile
    record: SlotRecord


def open_root(root: Path) -> int:
    """Create (0700) and open the memory folder itself, refusing one that is not ours.

    Refused (``UnsafePathError``): a folder others may write without the sticky
    bit, and one owned by another user unless it is a sticky folder of root's
    (``/dev/shm``, ``/tmp``): that user could read or replace every slot in it.
    """
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        if is_full(exc):
            raise full_error(exc, "the memory folder", str(root)) from None
        raise ConfigError(
            f"memory_folder={str(root)!r} cannot be created ({exc.strerror}); use a directory "
            "on a memory filesystem this user can write (e.g. /dev/shm/lm-resiliency-<user>), "
            "or memory_folder=None for process memory"
        ) from None
    fd = safe_open_root(root)
    st = os.fstat(fd)
    me = os.geteuid()
    shared = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if st.st_uid != me and not shared:
        os.close(fd)
        raise UnsafePathError(
            f"memory_folder={str(root)!r} is owned by {owner_of(st.st_uid)}, not by the user "
            f"running the job ({owner_of(me)}); that user could read or replace the memory "
            f"slots. Fix: chown {owner_of(me)} {root}, or choose a memory_folder this user "
            "owns (e.g. /dev/shm/lm-resiliency-<user>)",
            reason=FOREIGN_OWNER,
            path=str(root),
        )
    return fd


class MemoryFolder:
    """The slot files of one rank of one run and topology on this node.

    Construct once per manager (takes the folder's lock, waiting up to
    ``knobs.MEMORY_LOCK_WAIT_S`` for an exiting predecessor). Not collective.
    Raises ``UnsafePathError`` for a directory of another user, a link or a
    group/other-writable directory, and ``ResiliencyError`` when another live
    process holds the rank's folder.
    """

    def __init__(self, root: str | Path, *, run_id: str, topology: str, rank: int) -> None:
        self.root = Path(root)
        self.rank = rank
        self.run_id = run_id
        self._parts = (ns.run_dir(run_id), ns.topology_dir(topology), rank_dir(rank))
        self.path = self.root.joinpath(*self._parts)
        fds = [open_root(self.root)]
        try:
            where = self.root
            for part in self._parts:
                where = where / part
                # open_subdir refuses a link, a foreign owner and a group/other-writable dir
                try:
                    fds.append(open_subdir(fds[-1], part, create=True, where=str(where)))
                except OSError as exc:
                    if is_full(exc):  # out of inodes: the same as out of room
                        raise full_error(exc, "the memory slot folders", str(where)) from None
                    raise
            self.dir_fd = os.dup(fds[-1])
            self._run_fd = os.dup(fds[1])
        finally:
            for fd in fds:
                os.close(fd)
        try:
            self._lock_fd = self._lock()
        except BaseException:
            self.close()
            raise

    def _lock(self) -> int:
        where = str(self.path / LOCK_FILE)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(LOCK_FILE, flags, 0o600, dir_fd=self.dir_fd)
        except OSError as exc:
            if is_full(exc):
                raise full_error(exc, "the memory folder's lock file", where) from None
            if exc.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.ENODEV):
                raise self._bad_lock(where, exc.strerror or "cannot be opened") from None
            raise
        try:
            check_descriptor(fd, where)
        except SlotUnavailable as exc:
            kind = os.fstat(fd).st_mode
            os.close(fd)
            if exc.reason == NOT_A_FILE:
                raise self._bad_lock(where, _kind_name(kind)) from None
            raise UnsafePathError(str(exc), reason=exc.reason, path=where) from None
        try:
            locked = flock_within(fd, MEMORY_LOCK_WAIT_S)
        except OSError:
            os.close(fd)
            raise
        if not locked:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ResiliencyError(
                f"{self.path} is in use by another live process (pid {holder}); "
                "one process per rank: stop the other worker, or give this job "
                "another run_id"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    @staticmethod
    def _bad_lock(where: str, what: str) -> UnsafePathError:
        return UnsafePathError(
            f"memory folder lock {where} is not a regular file ({what}); lm-resiliency "
            "creates it as a private file and never uses anything else in its place. Fix: "
            f"remove it (rm -r {where}) if no job of yours uses this folder, or choose "
            "another memory_folder",
            reason=NOT_A_FILE,
            path=where,
        )

    def file_path(self, slot_name: str) -> Path:
        return self.path / slot_file_name(slot_name)

    def create(self, slot_name: str, data_bytes: int) -> SlotFile:
        """A new slot file for ``slot_name`` (an older file of that name is removed first)."""
        name = slot_file_name(slot_name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.dir_fd)
        return SlotFile.create(self.dir_fd, name, data_bytes, where=str(self.path / name))

    def attach(self, expected: dict[str, SlotIdentity]) -> tuple[list[Attached], list[str]]:
        """Open every committed slot of ``expected`` (slot name -> identity it must carry).

        Returns the usable slots and, for every file that was refused, a line
        naming it and the reason (refused files are left as they are).
        """
        found: list[Attached] = []
        problems: list[str] = []
        for slot_name, identity in expected.items():
            name = slot_file_name(slot_name)
            where = str(self.path / name)
            try:
                file, record = SlotFile.open_existing(self.dir_fd, name, identity, where=where)
            except FileNotFoundError:
                continue
            except SlotUnavailable as exc:
                problems.append(str(exc))
                continue
            found.append(Attached(slot_name, file, record))
        return found, problems

    def read_lineage(self) -> Lineage | None:
        """The run's timelines as this rank last recorded them here (``None`` if absent)."""
        where = str(self.path / LINEAGE_FILE)
        return read_lineage(self.dir_fd, LINEAGE_FILE, run_id=self.run_id, where=where)

    def write_lineage(self, lineage: Lineage) -> None:
        write_lineage(self.dir_fd, LINEAGE_FILE, lineage, run_id=self.run_id, rank=self.rank)

    def remove_all(self) -> None:
        """Delete every slot file and this rank's directory (after a successful run)."""
        for name in os.listdir(self.dir_fd):
            if name.endswith((_SUFFIX, ".tmp")) or name == LINEAGE_FILE:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.dir_fd)
        self.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path / LOCK_FILE)
            os.rmdir(self.path)
        for parent in (self.path.parent, self.path.parent.parent):
            with contextlib.suppress(OSError):  # not empty: other ranks of this node
                os.rmdir(parent)

    def other_topologies(self) -> list[str]:
        """This run's slot folders of other topologies (another world size or pairing).

        Listed, never removed: they belong to a job with another topology that may
        still run (or restart) and are removed when it finishes, or by ``lm-resiliency
        clean``.
        """
        mine = self._parts[1]
        return sorted(
            name for name in os.listdir(self._run_fd) if name != mine and ns.is_topology_dir(name)
        )

    def remove_superseded_topologies(self) -> list[str]:
        """Remove this run's slot folders of other topologies that no live process holds.

        A run restarted with another world size or pairing can never load them.
        Returns the removed directory names.
        """
        removed = []
        mine = self._parts[1]
        for name in os.listdir(self._run_fd):
            if name == mine or not ns.is_topology_dir(name):
                continue
            path = self.path.parent.parent / name
            if path.is_symlink() or not path.is_dir() or _in_use(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
        return removed

    def close(self) -> None:
        """Release the lock and the descriptors (slot files stay)."""
        for attr in ("_lock_fd", "dir_fd", "_run_fd"):
            fd = getattr(self, attr, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)


def _kind_name(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def _in_use(topology_path: Path) -> bool:
    """Whether any rank folder under ``topology_path`` is locked by a live process."""
    return any(is_locked(rank) for rank in topology_path.iterdir() if not rank.is_symlink())


def is_locked(rank_path: Path) -> bool:
    """Whether a live process holds the rank folder ``rank_path`` (for inspect and clean)."""
    lock = rank_path / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)

"""One slot arena as a file on a memory filesystem, with a commit record that says what it holds.

File layout (little endian)::

    page 0:   prefix  magic "LMRSLOT\\x01" | u32 version | u32 state | u64 generation |
                      i64 step | u64 data_bytes | u64 record_offset | u64 record_bytes |
                      u32 record_crc32c
    page 1..: the arena (``data_bytes``), mapped shared by the process that fills it
    then:     the commit record (JSON, ``record_bytes`` at ``record_offset``, page aligned)

The *state word* is the last thing written: a slot is marked ``WRITING``
before any of its bytes change and ``COMMITTED`` only after the arena and the
record are complete, so a process killed mid-copy or mid-receive leaves a
file that recovery never selects. The record names the run, topology, holder
rank, owner rank, role, generation, step, timeline, layout, non-tensor
document and one CRC-32C per chunk of the arena (always: a re-attached slot
is checked against them before any byte of it is used).

Space is reserved with ``posix_fallocate`` before the first byte is copied:
a full memory filesystem fails with :class:`MemoryFolderFull` (a clear error,
never SIGBUS on a page that could not be allocated). Files are created
``0600`` with ``O_EXCL``/``O_NOFOLLOW`` under a temp name and renamed into
place; an existing file is opened only when it is a regular file owned by us,
private to us and has a single link.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from lm_resiliency import _strict_json as strict_json
from lm_resiliency._safefs import pwrite_all
from lm_resiliency._tempnames import temp_name
from lm_resiliency.capture import Layout, populate
from lm_resiliency.checksums import arena_crcs, crc_count
from lm_resiliency.errors import CaptureError, ResiliencyError, StateSchemaError
from lm_resiliency.knobs import CRC_CHUNK_BYTES, SLOT_RECORD_RESERVE_BYTES
from lm_resiliency.state import validate_document

MAGIC = b"LMRSLOT\x01"
FORMAT_VERSION = 1
RECORD_KIND = "lm_resiliency.slot"
PAGE = mmap.PAGESIZE
_MAX_RECORD_BYTES = 256 * 1024 * 1024
_PREFIX = struct.Struct("<8sIIQqQQQI")
_STATE_OFFSET = 12
_RECORD_KEYS = {
    "kind",
    "version",
    "run_id",
    "topology",
    "holder_rank",
    "owner_rank",
    "role",
    "generation",
    "step",
    "timeline",
    "layout",
    "state",
    "integrity",
}


class SlotFileState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COMMITTED = 2


class SlotReason(str, enum.Enum):
    """Why an existing slot file is not used (stable codes, logged and shown by inspect)."""

    SYMLINK = "symlink"
    NOT_A_FILE = "not_a_file"
    FOREIGN_OWNER = "foreign_owner"
    PERMISSIONS = "permissions"
    HARD_LINK = "hard_link"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    NOT_COMMITTED = "not_committed"
    RECORD_CHECKSUM = "record_checksum"
    MALFORMED_RECORD = "malformed_record"
    IDENTITY = "identity"
    LAYOUT = "layout"
    STATE_SCHEMA = "state_schema"
    CHECKSUM_MISSING = "checksum_missing"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    IO_ERROR = "io_error"


class SlotUnavailable(ResiliencyError):
    """An existing slot file cannot be used; ``reason`` is a :class:`SlotReason` value."""

    def __init__(self, reason: SlotReason, path: str, detail: str) -> None:
        super().__init__(f"memory slot {path} is unusable ({reason.value}): {detail}")
        self.reason = reason.value
        self.path = path


class MemoryFolderFull(CaptureError):
    """The memory filesystem has no room for a slot; the message names folder, sizes and fixes."""


#: ``errno`` values that mean "this filesystem (or quota) has no room": out of blocks,
#: out of inodes (both ENOSPC) or over a quota.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_full(exc: OSError) -> bool:
    """Whether ``exc`` says the memory filesystem has no room (blocks, inodes or quota)."""
    return exc.errno in FULL_ERRNOS


def full_error(exc: OSError, what: str, where: str) -> MemoryFolderFull:
    """The :class:`MemoryFolderFull` for ``exc`` while making ``what`` in ``where``."""
    hint = " (out of space or of inodes: see df -h and df -i)" if exc.errno == errno.ENOSPC else ""
    return MemoryFolderFull(f"no room for {what} in {where}: {exc.strerror}{hint}")


@dataclass(frozen=True)
class SlotIdentity:
    """Where a slot belongs: run, topology, the rank whose folder holds it, its owner and role."""

    run_id: str
    topology: str
    holder_rank: int
    owner_rank: int
    role: str
    """``"own"`` (the holder's own state) or ``"held"`` (a peer's replica)."""


@dataclass(frozen=True)
class SlotRecord:
    """A validated commit record."""

    identity: SlotIdentity
    generation: int
    step: int
    timeline: str | None
    layout: Layout
    state: dict[str, Any]
    crcs: tuple[int, ...] | None
    """One CRC-32C per ``knobs.CRC_CHUNK_BYTES`` of the arena, or ``None`` (written without)."""


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def file_bytes_for(data_bytes: int) -> int:
    """Bytes a slot of ``data_bytes`` reserves on the memory filesystem."""
    return PAGE + round_up(data_bytes) + SLOT_RECORD_RESERVE_BYTES


class SlotFile:
    """An open slot file: its descriptor and the arena mapped shared (read-write).

    Not thread-safe; the slot that owns it serializes use. :meth:`release`
    drops this process's references (the file stays for a restarted process);
    :meth:`remove` also unlinks it when its name still refers to this file.
    """

    def __init__(self, dir_fd: int, name: str, fd: int, data_bytes: int, *, where: str) -> None:
        self._dir_fd = dir_fd
        self.name = name
        self.where = where
        self._fd: int | None = fd
        self.data_bytes = data_bytes
        self._inode = os.fstat(fd).st_ino
        self._mm: mmap.mmap | None = None
        self.arena = torch.empty(0, dtype=torch.uint8)
        if data_bytes:
            self._mm = mmap.mmap(
                fd,
                round_up(data_bytes),
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=PAGE,
            )
            self.arena = torch.frombuffer(self._mm, dtype=torch.uint8, count=data_bytes)
        self._pinned = False

    # -- creation and opening --------------------------------------------------

    @classmethod
    def create(cls, dir_fd: int, name: str, data_bytes: int, *, where: str) -> SlotFile:
        """Create a ``data_bytes`` slot named ``name`` (replacing any file of that name).

        The file is made under a temp name (``O_EXCL``, ``0600``), its space
        reserved and its pages mapped, then renamed into place in state EMPTY.
        Raises :class:`MemoryFolderFull` when the filesystem has no room.
        """
        tmp = temp_name(name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        total = file_bytes_for(data_bytes)
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if is_full(exc):  # e.g. a tmpfs out of inodes
                raise full_error(exc, f"a {total}-byte memory slot", where) from None
            raise
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if is_full(exc) or exc.errno == errno.ENOMEM:
                    raise full_error(exc, f"a {total}-byte memory slot", where) from None
                raise
            os.pwrite(fd, _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, -1, data_bytes, 0, 0, 0), 0)
            slot = cls(dir_fd, name, fd, data_bytes, where=where)
            populate(slot.arena)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return slot

    @classmethod
    def open_existing(
        cls, dir_fd: int, name: str, expected: SlotIdentity, *, where: str
    ) -> tuple[SlotFile, SlotRecord]:
        """Open a committed slot file and validate everything but its data checksums.

        Checks, in order: a regular file (never a link, FIFO or device, never
        blocking), owned by us, private (``0600``), one link; the prefix
        (magic, version, COMMITTED, sizes); the record (its CRC, JSON schema,
        identity against ``expected``, step and generation against the prefix,
        layout digest and size, the state document's schema). Raises
        :class:`SlotUnavailable` with the reason.
        """
        try:
            fd = os.open(
                name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SlotUnavailable(
                    SlotReason.SYMLINK, where, "a symlink; never followed"
                ) from None
            if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):
                raise SlotUnavailable(SlotReason.NOT_A_FILE, where, exc.strerror or "") from None
            raise
        try:
            record, data_bytes = _validate(fd, expected, where)
            return cls(dir_fd, name, fd, data_bytes, where=where), record
        except BaseException:
            os.close(fd)
            raise

    # -- the commit protocol -----------------------------------------------------

    def mark(self, state: SlotFileState) -> None:
        """Write the state word (WRITING before the arena changes, EMPTY to retract)."""
        os.pwrite(self._open_fd(), struct.pack("<I", int(state)), _STATE_OFFSET)

    def commit(
        self,
        identity: SlotIdentity,
        *,
        generation: int,
        step: int,
        timeline: str | None,
        layout: Layout,
        state: dict[str, Any],
        crcs: tuple[int, ...] | None,
    ) -> None:
        """Write the commit record, then the prefix, then the state word COMMITTED (last)."""
        if layout.total_bytes != self.data_bytes:
            raise ValueError(f"layout of {layout.total_bytes} bytes in a {self.data_bytes} slot")
        record = {
            "kind": RECORD_KIND,
            "version": FORMAT_VERSION,
            "run_id": identity.run_id,
            "topology": identity.topology,
            "holder_rank": identity.holder_rank,
            "owner_rank": identity.owner_rank,
            "role": identity.role,
            "generation": generation,
            "step": step,
            "timeline": timeline,
            "layout": layout.to_json(),
            "state": state,
            "integrity": None
            if crcs is None
            else {"chunk_bytes": CRC_CHUNK_BYTES, "chunks": [f"{c:08x}" for c in crcs]},
        }
        blob = json.dumps(record, separators=(",", ":"), allow_nan=False).encode()
        fd = self._open_fd()
        offset = PAGE + round_up(self.data_bytes)
        if len(blob) > SLOT_RECORD_RESERVE_BYTES:
            try:
                os.posix_fallocate(fd, offset, len(blob))
            except OSError as exc:
                raise full_error(exc, f"a {len(blob)}-byte commit record", self.where) from None
        self.mark(SlotFileState.WRITING)
        pwrite_all(fd, blob, offset)
        prefix = _PREFIX.pack(
            MAGIC,
            FORMAT_VERSION,
            int(SlotFileState.WRITING),
            generation,
            step,
            self.data_bytes,
            offset,
            len(blob),
            crc32c.crc32c(blob),
        )
        pwrite_all(fd, prefix, 0)
        self.mark(SlotFileState.COMMITTED)

    def verify(self, record: SlotRecord, *, required: bool = True) -> None:
        """Check the arena against the record's checksums; raise :class:`SlotUnavailable`.

        ``required``: a record without checksums is refused (``checksum_missing``).
        """
        if record.crcs is None:
            if required:
                raise SlotUnavailable(
                    SlotReason.CHECKSUM_MISSING,
                    self.where,
                    "its record carries no checksums (an older release wrote it), so its "
                    "bytes cannot be verified; memory slots are always checksummed",
                )
            return
        actual = arena_crcs(self.arena)
        bad = [i for i, (a, b) in enumerate(zip(actual, record.crcs, strict=True)) if a != b]
        if bad:
            raise SlotUnavailable(
                SlotReason.CHECKSUM_MISMATCH,
                self.where,
                f"arena chunk(s) {bad[:8]} do not match their CRC-32C: the memory was altered",
            )

    # -- lifetime ----------------------------------------------------------------

    def pin(self) -> bool:
        """Page-lock the mapped arena for asynchronous device copies (CUDA only)."""
        if self._pinned or not self.data_bytes or not torch.cuda.is_available():
            return self._pinned
        rc = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), self.data_bytes, 0)
        self._pinned = int(rc) == 0
        return self._pinned

    def _unpin(self) -> None:
        if self._pinned:
            # Before our mapping can go away: registered memory must not be unmapped first.
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self._pinned = False

    def hand_over(self) -> torch.Tensor:
        """Give the arena to the caller and take the file out of the slot namespace.

        The caller's tensor keeps the (now nameless) mapping alive; nothing in
        this library writes it again. The slot must allocate a new file for
        its next capture.
        """
        arena = self.arena
        self._unpin()
        self._unlink_if_ours()
        self._drop()
        return arena

    def release(self) -> None:
        """Drop this process's references; the file stays for a restarted process."""
        self._unpin()
        self._drop()

    def remove(self) -> None:
        """Unlink the file (when its name is still ours) and drop our references."""
        self._unpin()
        self._unlink_if_ours()
        self._drop()

    def _unlink_if_ours(self) -> None:
        with contextlib.suppress(OSError):
            st = os.stat(self.name, dir_fd=self._dir_fd, follow_symlinks=False)
            if st.st_ino == self._inode:
                os.unlink(self.name, dir_fd=self._dir_fd)

    def _drop(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)
        self._mm = None  # unmapped once no tensor of the caller's refers to it
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"memory slot {self.where} is closed")
        return self._fd


def _fail(reason: SlotReason, where: str, detail: str) -> SlotUnavailable:
    return SlotUnavailable(reason, where, detail)


def check_descriptor(fd: int, where: str) -> os.stat_result:
    """Refuse anything but a private regular file of ours with one link."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _fail(SlotReason.NOT_A_FILE, where, "not a regular file; never read")
    if st.st_uid != os.geteuid():
        raise _fail(
            SlotReason.FOREIGN_OWNER,
            where,
            f"owned by uid {st.st_uid}, not this process's uid {os.geteuid()}; "
            "memory slots of another user are never loaded",
        )
    if st.st_mode & 0o077:
        raise _fail(
            SlotReason.PERMISSIONS, where, f"mode {st.st_mode & 0o777:o} is not private (0600)"
        )
    if st.st_nlink != 1:
        raise _fail(SlotReason.HARD_LINK, where, f"{st.st_nlink} hard links; a slot has one")
    return st


def read_record(fd: int, where: str) -> tuple[SlotRecord, int]:
    """Validate open slot file ``fd`` exactly as :meth:`SlotFile.open_existing` does, but
    for the identity (which the caller checks); return its record and arena size.

    For tools that judge a slot from where it lies (``lm-resiliency inspect`` and
    ``clean``). Raises :class:`SlotUnavailable`, or ``OSError`` when a read fails.
    """
    return _validate(fd, None, where)


def _validate(fd: int, expected: SlotIdentity | None, where: str) -> tuple[SlotRecord, int]:
    size = check_descriptor(fd, where).st_size
    head = os.pread(fd, _PREFIX.size, 0)
    if len(head) < _PREFIX.size:
        raise _fail(SlotReason.TRUNCATED, where, f"{size} bytes, shorter than the prefix")
    magic, version, state, generation, step, data_bytes, rec_off, rec_bytes, rec_crc = (
        _PREFIX.unpack(head)
    )
    if magic != MAGIC:
        raise _fail(SlotReason.BAD_MAGIC, where, f"magic {magic!r} is not an lm-resiliency slot")
    if version != FORMAT_VERSION:
        raise _fail(
            SlotReason.UNSUPPORTED_VERSION,
            where,
            f"slot format {version}; this release reads {FORMAT_VERSION}",
        )
    if state != SlotFileState.COMMITTED:
        name = SlotFileState(state).name if state in (0, 1) else str(state)
        raise _fail(
            SlotReason.NOT_COMMITTED,
            where,
            f"state {name}: its writer stopped before the capture was complete",
        )
    want_off = PAGE + round_up(data_bytes)
    if rec_off != want_off or not 0 < rec_bytes <= _MAX_RECORD_BYTES:
        raise _fail(SlotReason.MALFORMED_RECORD, where, f"record at {rec_off} of {rec_bytes} bytes")
    if size < rec_off + rec_bytes:
        raise _fail(
            SlotReason.TRUNCATED, where, f"{size} bytes; the record ends at {rec_off + rec_bytes}"
        )
    blob = os.pread(fd, rec_bytes, rec_off)
    if len(blob) != rec_bytes or crc32c.crc32c(blob) != rec_crc:
        raise _fail(SlotReason.RECORD_CHECKSUM, where, "the commit record does not match its CRC")
    doc = _strict_json(blob, where)
    record = _parse_record(doc, where)
    found = record.identity
    if expected is not None and found != expected:
        raise _fail(
            SlotReason.IDENTITY,
            where,
            f"it belongs to {found}, not {expected}; a slot is never applied to another "
            "run, topology, rank or role",
        )
    if (record.generation, record.step) != (generation, step):
        raise _fail(SlotReason.MALFORMED_RECORD, where, "prefix and record disagree on the step")
    if record.layout.total_bytes != data_bytes:
        raise _fail(
            SlotReason.LAYOUT,
            where,
            f"layout of {record.layout.total_bytes} bytes for a {data_bytes}-byte arena",
        )
    if record.crcs is not None and len(record.crcs) != crc_count(data_bytes, CRC_CHUNK_BYTES):
        raise _fail(SlotReason.MALFORMED_RECORD, where, "checksums do not cover the arena")
    return record, data_bytes


def _strict_json(blob: bytes, where: str) -> Any:
    try:
        return strict_json.loads(blob)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(SlotReason.MALFORMED_RECORD, where, f"not valid JSON ({exc})") from None


def _is_int(value: Any, lo: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _parse_record(doc: Any, where: str) -> SlotRecord:
    if not isinstance(doc, dict) or doc.get("kind") != RECORD_KIND or set(doc) != _RECORD_KEYS:
        raise _fail(SlotReason.MALFORMED_RECORD, where, "not an lm-resiliency slot record")
    ok = (
        doc["version"] == FORMAT_VERSION
        and all(isinstance(doc[k], str) and doc[k] for k in ("run_id", "topology"))
        and all(_is_int(doc[k]) for k in ("holder_rank", "owner_rank", "generation", "step"))
        and doc["role"] in ("own", "held")
        and (doc["timeline"] is None or isinstance(doc["timeline"], str))
        and isinstance(doc["state"], dict)
    )
    if not ok:
        raise _fail(SlotReason.MALFORMED_RECORD, where, "a record field has the wrong type")
    try:
        layout = Layout.from_json(doc["layout"])
    except StateSchemaError as exc:
        raise _fail(SlotReason.LAYOUT, where, str(exc)) from None
    try:
        validate_document(doc["state"], tensor_count=len(layout.specs))
    except StateSchemaError as exc:
        raise _fail(SlotReason.STATE_SCHEMA, where, str(exc)) from None
    crcs = _parse_integrity(doc["integrity"], where)
    identity = SlotIdentity(
        doc["run_id"], doc["topology"], doc["holder_rank"], doc["owner_rank"], doc["role"]
    )
    return SlotRecord(
        identity, doc["generation"], doc["step"], doc["timeline"], layout, doc["state"], crcs
    )


def _parse_integrity(raw: Any, where: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    chunks = raw.get("chunks") if isinstance(raw, dict) else None
    if (
        not isinstance(raw, dict)
        or set(raw) != {"chunk_bytes", "chunks"}
        or raw["chunk_bytes"] != CRC_CHUNK_BYTES
        or not isinstance(chunks, list)
        or not all(isinstance(c, str) and len(c) == 8 for c in chunks)
    ):
        raise _fail(SlotReason.MALFORMED_RECORD, where, "malformed integrity section")
    try:
        return tuple(int(c, 16) for c in chunks)
    except ValueError:
        raise _fail(SlotReason.MALFORMED_RECORD, where, "a checksum is not hex") from None

"""Node-local format v3: a safetensors file whose metadata carries our document.

Byte layout (exactly safetensors, so any safetensors reader opens it)::

    u64 little-endian N | N bytes of JSON header, space-padded so 8 + N is a
    multiple of 8 | the arena bytes, tensor after tensor, no holes

The header maps each tensor name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the data start, equal to the layout's arena offsets) and
``"__metadata__"`` to ``{"lm_resiliency": "<the JSON document as a string>"}``
(safetensors metadata values must be strings); see
:mod:`lm_resiliency.persistence.document` for the document schema.

Writing is one sequential stream from the arena in ``chunk_bytes`` pieces; with
integrity each piece's CRC-32C is computed on a helper thread while the
previous piece is being written (``crc32c`` releases the GIL), and the header
- whose zeroed CRC placeholders have a fixed width - is rewritten in place at
the end. Reading validates the whole header before it reads a data byte, and
checks every CRC before it returns anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

from lm_resiliency import _strict_json as strict_json
from lm_resiliency._killpoints import kill_point
from lm_resiliency._safefs import pread_exact, preadinto_exact, pwrite_all, write_all
from lm_resiliency.capture import Layout, populate
from lm_resiliency.capture.target import Target
from lm_resiliency.errors import StateEncodingError
from lm_resiliency.knobs import CRC_CHUNK_BYTES
from lm_resiliency.persistence import document
from lm_resiliency.persistence.document import ShardDocument, ShardIdentity
from lm_resiliency.persistence.reasons import UnavailableReason, unavailable
from lm_resiliency.persistence.trust import TrustStatus

METADATA_KEY = "lm_resiliency"
#: The largest header safetensors itself accepts; ours is bounded the same.
MAX_HEADER_BYTES = 100_000_000
#: Kill point (see ``lm_resiliency.testing.kill_point``) after the first data chunk.
KILL_MID_WRITE = "persistence.write.after_first_chunk"

_R = UnavailableReason
_ST_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): st for name, st in _ST_NAMES.items() if hasattr(torch, name)
}
_LEGACY_MAGIC = ((b"PK\x03\x04", "a zip archive (torch.save)"), (b"\x80", "a pickle stream"))


@dataclass(frozen=True)
class ShardHeader:
    """A shard's validated header: its document plus where the data lies."""

    doc: ShardDocument
    data_offset: int
    file_bytes: int


def _safetensors_dtype(dtype: torch.dtype, name: str) -> str:
    try:
        return SAFETENSORS_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SAFETENSORS_DTYPES))
        raise StateEncodingError(
            f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
            f"convert it to one of: {supported}"
        ) from None


def check_storable(layout: Layout) -> None:
    """Raise ``StateEncodingError`` if a shard cannot store one of ``layout``'s dtypes.

    Names the first such tensor (in state order) by its key path and lists the
    dtypes that work. Called by the capture engine whenever a ``save()``'s
    layout is (re)built, so ``save()`` fails on the caller's thread instead of
    every later flush.
    """
    for spec in sorted(layout.specs, key=lambda s: s.index):
        if spec.dtype not in SAFETENSORS_DTYPES:
            supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SAFETENSORS_DTYPES))
            raise StateEncodingError(
                f"cannot encode state at {spec.name!r}: a tensor of dtype {spec.dtype} cannot be "
                "stored in a node-local shard (safetensors has no such dtype); convert it to "
                f"one of: {supported} (e.g. complex128 -> torch.view_as_real(t), a float64 pair)"
            )


def tensor_table(layout: Layout) -> dict[str, dict[str, Any]]:
    """The safetensors entries for ``layout``, in arena order."""
    table: dict[str, dict[str, Any]] = {}
    for s in layout.specs:
        if s.name == "__metadata__" or s.name in table:
            raise StateEncodingError(
                f"tensor name {s.name!r} is reserved or repeated; safetensors needs unique names"
            )
        table[s.name] = {
            "dtype": _safetensors_dtype(s.dtype, s.name),
            "shape": list(s.shape),
            "data_offsets": [s.offset_bytes, s.offset_bytes + s.nbytes],
        }
    return table


def encode_header(layout: Layout, doc: dict[str, Any]) -> bytes:
    """Length prefix + padded JSON header for ``layout`` and ``doc``."""
    meta = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    header = {"__metadata__": {METADATA_KEY: meta}, **tensor_table(layout)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise StateEncodingError(
            f"shard header of step {doc['step']} would be {len(text)} bytes, over the "
            f"{MAX_HEADER_BYTES}-byte safetensors limit; keep large values in tensors"
        )
    return struct.pack("<Q", len(text)) + text


def _arena_view(arena: torch.Tensor, layout: Layout) -> memoryview:
    if (
        arena.dtype != torch.uint8
        or arena.dim() != 1
        or arena.device.type != "cpu"
        or not arena.is_contiguous()
        or arena.numel() < layout.total_bytes
    ):
        raise ValueError(
            f"arena must be a contiguous flat uint8 CPU tensor of >= {layout.total_bytes} "
            f"bytes, got {arena.dtype} {tuple(arena.shape)} on {arena.device}"
        )
    view: memoryview = memoryview(arena.numpy())  # type: ignore[arg-type]
    return view[: layout.total_bytes]


def write_shard(
    fd: int,
    *,
    identity: ShardIdentity,
    layout: Layout,
    arena: torch.Tensor,
    state_document: dict[str, Any],
    trust: TrustStatus,
    integrity: bool,
    chunk_bytes: int = CRC_CHUNK_BYTES,
    timeline: str | None = None,
) -> int:
    """Write a complete shard to ``fd`` from offset 0; return its size in bytes.

    Raises ``StateEncodingError`` before writing anything when a dtype or name
    cannot be stored or the state is not strict JSON. The caller fsyncs.
    """
    data = _arena_view(arena, layout)
    doc = document.build(
        identity,
        trust=trust,
        layout=layout,
        state=state_document,
        chunk_bytes=chunk_bytes if integrity else None,
        timeline=timeline,
    )
    header = encode_header(layout, doc)
    write_all(fd, memoryview(header))
    crcs = _stream(fd, data, chunk_bytes, integrity)
    if integrity:
        final = encode_header(layout, document.with_chunk_crcs(doc, crcs))
        assert len(final) == len(header)  # fixed-width CRC placeholders
        pwrite_all(fd, final, 0)
    return len(header) + layout.total_bytes


def _stream(fd: int, data: memoryview, chunk_bytes: int, integrity: bool) -> list[int]:
    if not integrity:
        for off in range(0, len(data), chunk_bytes):
            write_all(fd, data[off : off + chunk_bytes])
            if off == 0:
                kill_point(KILL_MID_WRITE)
        return []
    futures: list[Future[int]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="lmr-crc") as pool:
        for off in range(0, len(data), chunk_bytes):
            piece = data[off : off + chunk_bytes]
            futures.append(pool.submit(crc32c.crc32c, piece))
            write_all(fd, piece)
            if off == 0:
                kill_point(KILL_MID_WRITE)
        return [f.result() for f in futures]


def read_header(fd: int, path: str | Path, *, file_bytes: int) -> ShardHeader:
    """Parse and validate everything but identity and data; raise ``ShardUnavailable``."""
    head = pread_exact(fd, 8, 0)
    if len(head) < 8:
        _legacy_check(head, path)
        raise unavailable(_R.TRUNCATED, path, f"only {file_bytes} bytes, shorter than a header")
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > MAX_HEADER_BYTES:
        _legacy_check(head, path)
        raise unavailable(
            _R.HEADER_TOO_LARGE,
            path,
            f"header length {header_bytes} exceeds the {MAX_HEADER_BYTES}-byte limit",
        )
    if 8 + header_bytes > file_bytes:
        _legacy_check(head, path)
        raise unavailable(
            _R.HEADER_OUT_OF_BOUNDS,
            path,
            f"header length {header_bytes} points past the end of the {file_bytes}-byte file",
        )
    raw = pread_exact(fd, header_bytes, 8)
    if not raw.lstrip().startswith(b"{"):
        _legacy_check(head, path)
    header = _parse_json(raw, path, "safetensors header")
    if not isinstance(header, dict):
        raise unavailable(_R.MALFORMED_HEADER, path, "the header is not a JSON object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(METADATA_KEY), str):
        raise unavailable(
            _R.FOREIGN_FORMAT,
            path,
            f"a safetensors file without an {METADATA_KEY!r} metadata document was not written "
            f"by lm-resiliency; {document.LEGACY_ADVICE}",
        )
    doc = document.parse(_parse_json(meta[METADATA_KEY].encode(), path, "document"), path)
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        expected = tensor_table(doc.layout)
    except StateEncodingError as exc:
        raise unavailable(_R.TENSOR_TABLE, path, str(exc)) from None
    if table != expected:
        extra = sorted(set(table) ^ set(expected))[:5]
        differ = [k for k in expected if k in table and table[k] != expected[k]][:5]
        raise unavailable(
            _R.TENSOR_TABLE,
            path,
            f"the safetensors tensor table disagrees with the recorded layout "
            f"(unmatched names {extra}, differing entries {differ})",
        )
    data_offset = 8 + header_bytes
    want = data_offset + doc.layout.total_bytes
    if file_bytes < want:
        raise unavailable(_R.TRUNCATED, path, f"{file_bytes} bytes but the header needs {want}")
    if file_bytes > want:
        raise unavailable(
            _R.SIZE_MISMATCH, path, f"{file_bytes - want} bytes beyond the {want} it describes"
        )
    return ShardHeader(doc=doc, data_offset=data_offset, file_bytes=file_bytes)


def _legacy_check(head: bytes, path: str | Path) -> None:
    # Only consulted once the bytes failed as safetensors: a valid header length
    # can begin with the same bytes as these signatures.
    for magic, what in _LEGACY_MAGIC:
        if head.startswith(magic):
            raise unavailable(
                _R.LEGACY_FORMAT,
                path,
                f"the file is {what}, not a format-v3 safetensors shard; {document.LEGACY_ADVICE}",
            )


def _parse_json(raw: bytes, path: str | Path, what: str) -> Any:
    try:
        return strict_json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise unavailable(
            _R.MALFORMED_HEADER, path, f"the {what} is not valid JSON ({exc})"
        ) from None


def read_data(
    fd: int,
    header: ShardHeader,
    path: str | Path,
    *,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read the arena bytes; verify every chunk CRC when the shard has them.

    Returns ``into`` (or a fresh flat ``uint8`` tensor) holding exactly the
    layout's bytes. On a checksum failure ``ShardIntegrityError`` is raised and
    whatever was read into ``into`` must be treated as garbage.
    """
    layout = header.doc.layout
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8) if into is None else into
    _arena_view(arena, layout)  # checks it
    _read_verified(fd, header, path, lambda off, n: [arena[off : off + n]])
    return arena


def read_into_target(fd: int, header: ShardHeader, path: str | Path, target: Target) -> None:
    """:func:`read_data` straight into the live tensors of ``target`` (same layout).

    Each chunk is one ``preadv`` over the tensors it spans; the same checks, and the
    same contract: after a failure the target's bytes are garbage.
    """
    layout = header.doc.layout
    if not target.matches(layout):
        raise ValueError(
            f"{path}: the target's layout {target.layout.digest} is not the shard's {layout.digest}"
        )
    _read_verified(fd, header, path, target.pieces)


def _read_verified(
    fd: int,
    header: ShardHeader,
    path: str | Path,
    views: Callable[[int, int], list[torch.Tensor]],
) -> None:
    """Read the data bytes into ``views(offset, nbytes)``, chunk by chunk, CRCs checked."""
    total = header.doc.layout.total_bytes
    integ = header.doc.integrity
    chunk = integ.chunk_bytes if integ is not None else CRC_CHUNK_BYTES
    futures: list[Future[int]] = []
    with contextlib.suppress(OSError):  # a hint: the kernel reads further ahead
        os.posix_fadvise(fd, header.data_offset, total, os.POSIX_FADV_SEQUENTIAL)

    def map_pages(off: int) -> None:
        for v in views(off, min(chunk, total - off)):
            populate(v)

    def crc(pieces: list[memoryview]) -> int:
        value = 0
        for p in pieces:
            value = crc32c.crc32c(p, value)
        return value

    # The helper thread maps the next chunk's pages while this one waits for the disk,
    # then checksums the chunk just read; the reads themselves never wait for either.
    with ThreadPoolExecutor(1, thread_name_prefix="lmr-crc") as pool:
        if total:
            pool.submit(map_pages, 0)
        for off in range(0, total, chunk):
            if off + chunk < total:
                pool.submit(map_pages, off + chunk)
            pieces = [memoryview(v.numpy()) for v in views(off, min(chunk, total - off))]  # type: ignore[arg-type]
            want = sum(len(p) for p in pieces)
            got = _preadv_exact(fd, pieces, header.data_offset + off)
            if got != want:
                raise unavailable(
                    _R.TRUNCATED, path, f"the file ended {total - off - got} bytes early"
                )
            if integ is not None:
                futures.append(pool.submit(crc, pieces))
        if integ is not None:
            for i, (f, want) in enumerate(zip(futures, integ.chunks, strict=True)):
                if f.result() != want:
                    raise unavailable(
                        _R.CHECKSUM_MISMATCH,
                        path,
                        f"data chunk {i} (bytes {i * chunk}..{min(total, (i + 1) * chunk)}) does "
                        "not match its CRC-32C: the stored bytes are damaged",
                    )


def _preadv_exact(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from ``offset``; the bytes read (short only at end of file)."""
    if len(views) == 1:
        return preadinto_exact(fd, views[0], offset)
    done = 0
    rest = list(views)
    while rest:
        n = os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
        while rest and n >= len(rest[0]):
            n -= len(rest[0])
            rest.pop(0)
        if rest and n:
            rest[0] = rest[0][n:]
    return done

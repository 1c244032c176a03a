"""Disk corruption for drills and tests: damage a real shard file the way storage or a forger would.

Each function edits a format-v3 shard in place. :func:`edit_document` rewrites
the embedded metadata document; with ``fix_crc`` it recomputes the document's
CRC exactly as ``docs/persistence.md`` specifies, which is what a careful
forger (or a bug that writes a well-formed but wrong document) produces: the
header checks pass and only validation of the content itself can refuse it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c

__all__ = ["data_start", "document_crc", "edit_document", "flip_data_byte"]


def data_start(raw: bytes | bytearray) -> int:
    """Offset of the first data byte of a shard's bytes."""
    return 8 + int(struct.unpack("<Q", raw[:8])[0])


def flip_data_byte(path: Path, offset: int = 5) -> None:
    """Flip one bit of the data byte at ``offset`` (only a CRC can tell)."""
    raw = bytearray(path.read_bytes())
    raw[data_start(raw) + offset] ^= 0x01
    path.write_bytes(bytes(raw))


def document_crc(doc: dict[str, Any]) -> str:
    """The document CRC as docs/persistence.md specifies it."""
    body = {k: v for k, v in doc.items() if k != "document_crc32c"}
    if isinstance(body.get("integrity"), dict):
        body["integrity"] = {k: v for k, v in body["integrity"].items() if k != "chunks"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{crc32c.crc32c(text):08x}"


def edit_document(
    path: Path, edit: Callable[[dict[str, Any]], None], *, fix_crc: bool = False
) -> None:
    """Rewrite the embedded document of the shard at ``path`` (the data stays as it was)."""
    raw = path.read_bytes()
    start = data_start(raw)
    header = json.loads(raw[8:start])
    doc = json.loads(header["__metadata__"]["lm_resiliency"])
    edit(doc)
    if fix_crc:
        doc["document_crc32c"] = document_crc(doc)
    header["__metadata__"]["lm_resiliency"] = json.dumps(doc)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[start:])

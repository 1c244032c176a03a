"""The JSON header that precedes a replicated arena on the wire.

The header says whose state the bytes are (run, owner rank, step), how to read
them (the layout and its digest) and carries the non-tensor state document. It
travels as UTF-8 JSON bytes: no pickle. A receiver checks it with
:func:`check_header` before it accepts a single arena byte.
"""

from __future__ import annotations

import json
from typing import Any

from lm_resiliency.capture.layout import Layout
from lm_resiliency.errors import ReplicationError, StateSchemaError

HEADER_VERSION = 1
"""Version of the header document; a receiver rejects any other."""

_FIELDS = (
    "version",
    "run_id",
    "owner_rank",
    "step",
    "layout",
    "layout_digest",
    "total_bytes",
    "state_document",
)


def make_header(
    run_id: str,
    owner_rank: int,
    step: int,
    layout: Layout,
    state_document: dict[str, Any],
) -> dict[str, Any]:
    """The header for ``owner_rank``'s arena of ``step`` laid out by ``layout``.

    ``state_document`` is the JSON document of the non-tensor state (scheduler,
    sampler, RNG, training position); it must already be JSON-encodable.
    Raises ``ValueError`` for arguments of the wrong type or range.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id={run_id!r} must be a non-empty string")
    for name, value in (("owner_rank", owner_rank), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an integer >= 0")
    if not isinstance(state_document, dict):
        raise ValueError(f"state_document must be a dict, got {type(state_document).__name__}")
    return {
        "version": HEADER_VERSION,
        "run_id": run_id,
        "owner_rank": owner_rank,
        "step": step,
        "layout": layout.to_json(),
        "layout_digest": layout.digest,
        "total_bytes": layout.total_bytes,
        "state_document": state_document,
    }


def encode_header(header: dict[str, Any]) -> bytes:
    """UTF-8 JSON bytes of ``header`` (raises ``ValueError`` if not JSON-encodable)."""
    try:
        return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"replication header is not JSON-encodable: {exc}") from None


def decode_header(blob: bytes) -> dict[str, Any]:
    """Parse header bytes; raises ``ReplicationError`` unless they hold a JSON object."""
    try:
        doc = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReplicationError(f"replication header is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReplicationError(f"replication header is a JSON {type(doc).__name__}, not an object")
    return doc


def check_header(
    header: dict[str, Any],
    *,
    run_id: str,
    owner_rank: int,
    step: int,
) -> Layout:
    """Validate a received header and return its layout.

    Checks, in order: every field is present, the version, the run id, the owner
    rank, the step, that the layout document rebuilds with its own digest, and
    that ``layout_digest`` and ``total_bytes`` agree with it. Raises
    :class:`~lm_resiliency.errors.ReplicationError` naming the first mismatch
    (expected and received values).
    """
    missing = [f for f in _FIELDS if f not in header]
    if missing:
        raise ReplicationError(f"header lacks field(s) {', '.join(missing)}")
    if header["version"] != HEADER_VERSION:
        raise ReplicationError(
            f"header version {header['version']!r} is not the supported {HEADER_VERSION}"
        )
    if header["run_id"] != run_id:
        raise ReplicationError(
            f"header run_id {header['run_id']!r} does not match this run's {run_id!r}"
        )
    if header["owner_rank"] != owner_rank:
        raise ReplicationError(
            f"header owner_rank {header['owner_rank']!r} is not the expected owner {owner_rank}"
        )
    if header["step"] != step:
        raise ReplicationError(f"header step {header['step']!r} is not the expected step {step}")
    try:
        layout = Layout.from_json(header["layout"])
    except StateSchemaError as exc:
        raise ReplicationError(f"header layout is invalid: {exc}") from None
    if header["layout_digest"] != layout.digest:
        raise ReplicationError(
            f"header layout_digest {header['layout_digest']!r} does not match the layout's "
            f"digest {layout.digest!r}"
        )
    if header["total_bytes"] != layout.total_bytes:
        raise ReplicationError(
            f"header total_bytes {header['total_bytes']!r} does not match the layout's "
            f"{layout.total_bytes}"
        )
    if not isinstance(header["state_document"], dict):
        raise ReplicationError("header state_document is not a JSON object")
    return layout

"""The versioned JSON document a format-v3 shard carries in its safetensors metadata.

Schema (every key required, no others)::

    {"kind": "lm_resiliency.shard", "format_version": 3,
     "run_id": str, "topology": str, "owner_rank": int >= 0, "step": int >= 0,
     "trust": "unverified" | "candidate" | "recovery_verified",
     "layout": <Layout.to_json()>, "state": {<non-tensor state document>},
     "integrity": null | {"algorithm": "crc32c", "chunk_bytes": int > 0,
                          "chunks": ["%08x", ...]},
     "timeline": str | null,          (optional: absent in files written before timelines)
     "document_crc32c": "%08x"}

``integrity`` (present with ``verify_integrity``) holds one CRC-32C per
``chunk_bytes`` of tensor data. ``document_crc32c`` is always present: the
CRC-32C of this document's canonical JSON (sorted keys, compact) without
itself and without the chunk CRC values, so a flipped byte in the identity,
the layout or the non-tensor state is caught in every shard - it costs
nothing next to the tensor bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from lm_resiliency.capture import Layout
from lm_resiliency.errors import StateEncodingError, StateSchemaError
from lm_resiliency.persistence.reasons import UnavailableReason, unavailable
from lm_resiliency.persistence.trust import TrustStatus
from lm_resiliency.state import decode_state, validate_document

_R = UnavailableReason
FORMAT_VERSION = 3
DOCUMENT_KIND = "lm_resiliency.shard"
CRC_ALGORITHM = "crc32c"
MAX_CHUNK_BYTES = 1 << 30
_KEYS = {
    "kind",
    "format_version",
    "run_id",
    "topology",
    "owner_rank",
    "step",
    "trust",
    "layout",
    "state",
    "integrity",
    "document_crc32c",
}
_OPTIONAL_KEYS = {"timeline"}
_INTEGRITY_KEYS = {"algorithm", "chunk_bytes", "chunks"}
_HEX8 = re.compile(r"[0-9a-f]{8}")
LEGACY_ADVICE = (
    "node-local files of format v1/v2 are not bound to a run and topology and are never "
    "loaded by this release: resume them with the release that wrote them (then save a "
    "durable framework checkpoint), or start this run from the framework's durable checkpoint"
)


@dataclass(frozen=True)
class ShardIdentity:
    """The four facts that bind a shard to exactly one place in one run."""

    run_id: str
    topology: str
    owner_rank: int
    step: int


@dataclass(frozen=True)
class Integrity:
    """CRC-32C values, one per ``chunk_bytes`` of tensor data."""

    chunk_bytes: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class ShardDocument:
    """A validated shard document (identity not yet compared with expectations)."""

    identity: ShardIdentity
    trust: TrustStatus
    layout: Layout
    state: dict[str, Any]
    integrity: Integrity | None
    timeline: str | None = None
    """The timeline that wrote the shard (see ``persistence.lineage``), if recorded."""


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """How many CRC chunks cover ``total_bytes`` (0 for an empty arena)."""
    return -(-total_bytes // chunk_bytes)


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "document_crc32c"}
    if isinstance(body.get("integrity"), dict):
        # The chunk values are known only after the data; they check themselves.
        body["integrity"] = {k: v for k, v in body["integrity"].items() if k != "chunks"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def build(
    identity: ShardIdentity,
    *,
    trust: TrustStatus,
    layout: Layout,
    state: dict[str, Any],
    chunk_bytes: int | None,
    timeline: str | None = None,
) -> dict[str, Any]:
    """The document for a new shard, with zeroed chunk CRCs when ``chunk_bytes`` is given.

    Fill the chunk CRCs with :func:`with_chunk_crcs` once the data is written.
    Raises ``StateEncodingError`` if ``state`` is not strict JSON (NaN,
    non-string keys, objects JSON cannot express).
    """
    if not isinstance(state, dict):
        raise StateEncodingError(
            f"state_document must be a dict (a JSON object), got {type(state).__name__}"
        )
    doc: dict[str, Any] = {
        "kind": DOCUMENT_KIND,
        "format_version": FORMAT_VERSION,
        "run_id": identity.run_id,
        "topology": identity.topology,
        "owner_rank": identity.owner_rank,
        "step": identity.step,
        "trust": TrustStatus(trust).value,
        "layout": layout.to_json(),
        "state": state,
        "integrity": None,
        "timeline": timeline,
    }
    if chunk_bytes is not None:
        doc["integrity"] = {
            "algorithm": CRC_ALGORITHM,
            "chunk_bytes": chunk_bytes,
            "chunks": ["00000000"] * chunk_count(layout.total_bytes, chunk_bytes),
        }
    try:
        canonical = _canonical(doc)
    except (TypeError, ValueError) as exc:
        raise StateEncodingError(
            f"state_document of step {identity.step} is not strict JSON ({exc}); "
            "encode it with lm_resiliency.state before persisting"
        ) from None
    doc["document_crc32c"] = f"{crc32c.crc32c(canonical):08x}"
    return doc


def with_chunk_crcs(doc: dict[str, Any], crcs: list[int]) -> dict[str, Any]:
    """``doc`` with its placeholder chunk CRCs replaced (same encoded length)."""
    integrity = dict(doc["integrity"])
    assert len(crcs) == len(integrity["chunks"]), (len(crcs), len(integrity["chunks"]))
    integrity["chunks"] = [f"{c:08x}" for c in crcs]
    return {**doc, "integrity": integrity}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse(doc: Any, path: str | Path) -> ShardDocument:
    """Validate the document schema and its own CRC; raise ``ShardUnavailable`` with the reason.

    Legacy versions (1, 2) raise ``LEGACY_FORMAT`` with what to do; a newer
    version raises ``UNSUPPORTED_VERSION``; anything malformed raises
    ``SCHEMA`` or ``LAYOUT``; a document CRC mismatch ``CHECKSUM_MISMATCH``.
    """
    if not isinstance(doc, dict):
        raise unavailable(_R.SCHEMA, path, "the lm_resiliency metadata is not a JSON object")
    version = doc.get("format_version")
    if version in (1, 2):
        raise unavailable(_R.LEGACY_FORMAT, path, f"written in format v{version}; {LEGACY_ADVICE}")
    if not _int(version) or doc.get("kind") != DOCUMENT_KIND:
        raise unavailable(
            _R.FOREIGN_FORMAT,
            path,
            f"kind={doc.get('kind')!r} format_version={version!r} is not an lm-resiliency shard; "
            f"{LEGACY_ADVICE}",
        )
    if version != FORMAT_VERSION:
        raise unavailable(
            _R.UNSUPPORTED_VERSION,
            path,
            f"format_version={version} was written by a newer release (this one reads "
            f"{FORMAT_VERSION}); upgrade lm-resiliency to load it",
        )
    if not _KEYS <= set(doc) <= _KEYS | _OPTIONAL_KEYS:
        raise unavailable(_R.SCHEMA, path, f"document keys {sorted(doc)} != {sorted(_KEYS)}")
    problems = []
    for key in ("run_id", "topology"):
        if not isinstance(doc[key], str) or not doc[key]:
            problems.append(f"{key} must be a non-empty string")
    for key in ("owner_rank", "step"):
        if not _int(doc[key]):
            problems.append(f"{key} must be an int >= 0, got {doc[key]!r}")
    if not isinstance(doc["trust"], str) or doc["trust"] not in {t.value for t in TrustStatus}:
        problems.append(f"trust={doc['trust']!r} is not one of {[t.value for t in TrustStatus]}")
    if not isinstance(doc["state"], dict):
        problems.append("state must be a JSON object")
    timeline = doc.get("timeline")
    if timeline is not None and not (isinstance(timeline, str) and 0 < len(timeline) <= 128):
        problems.append(f"timeline={timeline!r:.60} must be a short string or null")
    if problems:
        raise unavailable(_R.SCHEMA, path, "; ".join(problems))
    integrity = _parse_integrity(doc, path)
    stored = doc["document_crc32c"]
    if not (isinstance(stored, str) and _HEX8.fullmatch(stored)):
        raise unavailable(_R.SCHEMA, path, f"document_crc32c={stored!r:.40} is not 8 hex digits")
    if crc32c.crc32c(_canonical(doc)) != int(stored, 16):
        raise unavailable(
            _R.CHECKSUM_MISMATCH,
            path,
            "the metadata document does not match its CRC-32C (damaged header); "
            "the shard cannot be trusted",
        )
    try:
        layout = Layout.from_json(doc["layout"])
    except StateSchemaError as exc:
        raise unavailable(_R.LAYOUT, path, str(exc)) from None
    if integrity is not None and len(integrity.chunks) != chunk_count(
        layout.total_bytes, integrity.chunk_bytes
    ):
        raise unavailable(
            _R.SCHEMA,
            path,
            f"{len(integrity.chunks)} chunk CRCs do not cover {layout.total_bytes} bytes "
            f"in chunks of {integrity.chunk_bytes}",
        )
    identity = ShardIdentity(doc["run_id"], doc["topology"], doc["owner_rank"], doc["step"])
    return ShardDocument(
        identity, TrustStatus(doc["trust"]), layout, doc["state"], integrity, timeline
    )


def _parse_integrity(doc: dict[str, Any], path: str | Path) -> Integrity | None:
    raw = doc["integrity"]
    if raw is None:
        return None
    bad = unavailable(UnavailableReason.SCHEMA, path, f"malformed integrity section {raw!r:.200}")
    if not isinstance(raw, dict) or set(raw) != _INTEGRITY_KEYS:
        raise bad
    chunk_bytes, chunks = raw["chunk_bytes"], raw["chunks"]
    if (
        raw["algorithm"] != CRC_ALGORITHM
        or not _int(chunk_bytes)
        or not 0 < chunk_bytes <= MAX_CHUNK_BYTES
        or not isinstance(chunks, list)
        or not all(isinstance(c, str) and _HEX8.fullmatch(c) for c in chunks)
    ):
        raise bad
    return Integrity(chunk_bytes, tuple(int(c, 16) for c in chunks))


def check_state(doc: ShardDocument, path: str | Path, *, arena: Any = None) -> None:
    """Judge the shard's state document as recovery does before it uses it.

    With ``arena`` (the shard's data, a flat ``uint8`` tensor) the document is
    decoded with the layout's views, exactly as recovery's ``decode_state`` call
    does; without, the same walk runs without the tensors
    (:func:`~lm_resiliency.state.validate_document` with the layout's tensor
    count). Raises ``ShardUnavailable`` (``schema``) naming the problem.
    """
    try:
        if arena is None:
            validate_document(doc.state, tensor_count=len(doc.layout.specs))
        else:
            decode_state(doc.state, doc.layout.views(arena))
    except StateSchemaError as exc:
        raise unavailable(
            _R.SCHEMA, path, f"its state document is one recovery refuses: {exc}"
        ) from None


def check_identity(found: ShardIdentity, expected: ShardIdentity, path: str | Path) -> None:
    """Raise ``ShardIdentityMismatch`` naming the first of run, topology, owner, step to differ."""
    checks = (
        (_R.IDENTITY_RUN, "run_id", found.run_id, expected.run_id),
        (_R.IDENTITY_TOPOLOGY, "topology", found.topology, expected.topology),
        (_R.IDENTITY_OWNER, "owner_rank", found.owner_rank, expected.owner_rank),
        (_R.IDENTITY_STEP, "step", found.step, expected.step),
    )
    for reason, name, got, want in checks:
        if got != want:
            raise unavailable(
                reason,
                path,
                f"it records {name}={got!r} but this location belongs to {name}={want!r}; "
                "a shard is never applied to another run, topology, rank or step",
            )

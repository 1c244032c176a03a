"""Strict JSON for documents that come from files, slots or peers (a leaf module).

Standard JSON only: no NaN/Infinity constants (``json`` accepts them by
default) and no duplicate keys (``json`` keeps the last one silently, so two
readers could disagree on what a document says).
"""

from __future__ import annotations

import json
from typing import Any


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys")
    return out


def loads(raw: bytes) -> Any:
    """Parse UTF-8 JSON bytes strictly; raises ``ValueError`` (or ``RecursionError``) only."""
    return json.loads(
        raw.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates
    )

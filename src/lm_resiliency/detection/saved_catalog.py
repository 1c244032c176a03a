"""SCOUT's catalog saved with the trust records, so a restarted job can sweep before training.

A hang or an unknown failure with every rank reachable is decided by a sweep of
the whole catalog (docs/scout.md, "Recovery decisions"). A replay needs each
block's call signature, which the source peer records from the training's
forwards; a restarted process has run none yet. So the source saves what it
recorded - each block's latest :class:`~lm_resiliency.detection.signature.CallSignature`
and the discovered dynamic recipes, shapes and argument structures only, never a
tensor - through the trust ledger (``scout-catalog-rank-<R>.json`` beside the
status sidecar), whenever it changed, after a capture. The restarted source
reads it back and replays those shapes until the training records fresh ones.

The document (strict JSON)::

    {"kind": "lm_resiliency.scout_catalog", "version": 1, "layout": "<16 hex>",
     "dense": [<signature> | null, ...],        # one per block, in block order
     "dynamic": [<signature>, ...]}              # discovered dynamic recipes

``layout`` fingerprints the block partition (types, parameter shapes and dtypes)
and the dynamic modules: a catalog of another layout (another model, another
partition) is ignored with a log line, as is a malformed one (the error names the
file and what is wrong). Either way the sweep then lacks shapes, is incomplete,
and recovery is verified: a bad catalog costs speed, never safety.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lm_resiliency.detection.blocks import Block, static_key, structure_fingerprint
from lm_resiliency.detection.recipes import DynamicCatalog
from lm_resiliency.detection.signature import CallSignature, Recorder, decode, encode

log = logging.getLogger(__name__)

CATALOG_KIND = "lm_resiliency.scout_catalog"
CATALOG_VERSION = 1
_KEYS = {"kind", "version", "layout", "dense", "dynamic"}
_MAX_ITEMS = 4096
_MAX_DEPTH = 8


class CatalogError(ValueError):
    """A saved catalog that cannot be used (its message names the problem and the fix)."""


@runtime_checkable
class CatalogStore(Protocol):
    """Where the catalog is kept (the GEMINI trust ledger, ``manager.trust``)."""

    def save_catalog(self, doc: dict[str, Any]) -> None: ...

    def saved_catalog(self) -> Any: ...


def layout_of(blocks: Sequence[Block], dynamic: DynamicCatalog | None) -> str:
    """The fingerprint a saved catalog must match: the block partition and dynamic modules."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{structure_fingerprint(list(blocks)):016x}".encode())
    if dynamic is not None:
        first = Block(0, dynamic.modules[0], "", tuple(dynamic.modules[0].parameters()))
        h.update(f"|{len(dynamic.modules)}|{static_key(first)}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class SavedCatalog:
    """A catalog read back: per block its signature (or ``None``), the dynamic recipes."""

    layout: str
    dense: tuple[CallSignature | None, ...]
    dynamic: tuple[CallSignature, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": CATALOG_KIND,
            "version": CATALOG_VERSION,
            "layout": self.layout,
            "dense": [None if s is None else encode(s) for s in self.dense],
            "dynamic": [encode(s) for s in self.dynamic],
        }

    @classmethod
    def from_json(cls, doc: Any) -> SavedCatalog:
        """Parse and check a catalog document; raises :class:`CatalogError`."""
        if not isinstance(doc, dict) or doc.get("kind") != CATALOG_KIND:
            raise CatalogError(f"not a SCOUT catalog (kind must be {CATALOG_KIND!r})")
        if doc.get("version") != CATALOG_VERSION:
            raise CatalogError(
                f"catalog version {doc.get('version')!r}; this release reads version "
                f"{CATALOG_VERSION} only (it is rewritten after the next capture)"
            )
        if set(doc) != _KEYS:
            raise CatalogError(f"catalog keys {sorted(doc)}; expected {sorted(_KEYS)}")
        layout, dense, dynamic = doc["layout"], doc["dense"], doc["dynamic"]
        if not (isinstance(layout, str) and len(layout) == 16):
            raise CatalogError(f"layout={layout!r:.40} is not a 16-digit fingerprint")
        for name, rows in (("dense", dense), ("dynamic", dynamic)):
            if not isinstance(rows, list) or len(rows) > _MAX_ITEMS:
                raise CatalogError(f"{name} must be a list of at most {_MAX_ITEMS} signatures")
        return cls(
            layout,
            tuple(None if d is None else _signature(d, f"dense[{i}]") for i, d in enumerate(dense)),
            tuple(_signature(d, f"dynamic[{i}]") for i, d in enumerate(dynamic)),
        )


def _signature(doc: Any, where: str) -> CallSignature:
    if not (isinstance(doc, dict) and set(doc) == {"args", "kwargs", "autocast"}):
        raise CatalogError(f"{where}: a signature has exactly the keys args, kwargs, autocast")
    args, kwargs, autocast = doc["args"], doc["kwargs"], doc["autocast"]
    if not isinstance(args, list) or not isinstance(kwargs, list):
        raise CatalogError(f"{where}: args and kwargs must be lists")
    for i, a in enumerate(args):
        _arg(a, f"{where}.args[{i}]", 0)
    for i, kv in enumerate(kwargs):
        if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)):
            raise CatalogError(f"{where}.kwargs[{i}] must be [name, argument]")
        _arg(kv[1], f"{where}.kwargs[{kv[0]}]", 0)
    if not (
        isinstance(autocast, list)
        and len(autocast) == 2
        and isinstance(autocast[0], bool)
        and _dtype(autocast[1])
    ):
        raise CatalogError(f"{where}.autocast={autocast!r:.60} must be [enabled, dtype name]")
    return decode(doc)


def _dtype(name: Any) -> bool:
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _arg(doc: Any, where: str, depth: int) -> None:
    if depth > _MAX_DEPTH or not isinstance(doc, dict):
        raise CatalogError(f"{where} is not an argument description")
    kind = doc.get("k")
    if kind == "t":
        shape, rng = doc.get("shape"), doc.get("range")
        ok = (
            set(doc) == {"k", "shape", "dtype", "rg", "range"}
            and isinstance(shape, list)
            and all(_int(d) and d >= 0 for d in shape)
            and _dtype(doc["dtype"])
            and isinstance(doc["rg"], bool)
            and (rng is None or (isinstance(rng, list) and len(rng) == 2 and all(map(_int, rng))))
        )
        if not ok:
            raise CatalogError(f"{where}: a tensor is {{k, shape (ints >= 0), dtype, rg, range}}")
    elif kind == "v":
        value = doc.get("v")
        if set(doc) != {"k", "v"} or not (
            value is None or isinstance(value, (bool, int, float, str))
        ):
            raise CatalogError(f"{where}: a scalar is {{k, v}} with a plain value")
    elif kind == "s":
        items = doc.get("items")
        if set(doc) != {"k", "kind", "items"} or doc["kind"] not in ("tuple", "list"):
            raise CatalogError(f"{where}: a sequence is {{k, kind (tuple|list), items}}")
        if not isinstance(items, list):
            raise CatalogError(f"{where}.items must be a list")
        for i, item in enumerate(items):
            _arg(item, f"{where}.items[{i}]", depth + 1)
    else:
        raise CatalogError(f"{where}: unknown argument kind {kind!r:.20}")


class CatalogKeeper:
    """The source peer's side: read the saved catalog once, save it again when it changed.

    ``store``: the trust ledger (``None``, or one without catalog methods: nothing is
    kept). Local calls only, on the training thread; writes run in the background.
    """

    def __init__(
        self,
        store: object,
        *,
        layout: str,
        recorder: Recorder | None,
        dynamic: DynamicCatalog | None,
    ) -> None:
        self.store = store if isinstance(store, CatalogStore) else None
        self.layout = layout
        self.recorder = recorder
        self.discovered = dynamic is not None and dynamic.shapes is None
        self._saved: tuple[tuple[CallSignature | None, ...], tuple[CallSignature, ...]] | None
        self._saved = None

    def load(self, n_blocks: int) -> SavedCatalog | None:
        """The saved catalog if it fits this model (else ``None``, with a log line saying why)."""
        if self.store is None:
            return None
        try:
            doc = self.store.saved_catalog()
            if doc is None:
                return None  # nothing saved yet
            found = SavedCatalog.from_json(doc)
        except CatalogError as exc:
            log.warning(
                "SCOUT ignores its saved catalog: %s; a sweep before training lacks "
                "shapes (recovery is verified) until the next capture saves it",
                exc,
            )
            return None
        except (ValueError, OSError) as exc:  # not strict JSON, too large, not our file
            log.warning("SCOUT ignores its saved catalog: %s", exc)
            return None
        if found.layout != self.layout or len(found.dense) != n_blocks:
            log.warning(
                "SCOUT ignores its saved catalog: it was recorded for another model layout "
                "(fingerprint %s, %d blocks; this model: %s, %d blocks)",
                found.layout, len(found.dense), self.layout, n_blocks,
            )  # fmt: skip
            return None
        log.info(
            "SCOUT read its saved catalog: %d of %d block signatures, %d dynamic recipes",
            sum(s is not None for s in found.dense), n_blocks, len(found.dynamic),
        )  # fmt: skip
        self._saved = (found.dense, found.dynamic)
        return found

    def maybe_save(self, snapshot: Sequence[CallSignature]) -> None:
        """Save the recorded signatures (and discovered ``snapshot``) if they changed."""
        if self.store is None or self.recorder is None:
            return
        dense = tuple(self.recorder.signature(i) for i in range(len(self.recorder.modules)))
        dynamic = tuple(snapshot) if self.discovered else ()
        if all(s is None for s in dense) and not dynamic:
            return
        if self._saved is not None:
            # Keep what the saved catalog knew for blocks this process has not recorded yet.
            old_dense, old_dyn = self._saved
            dense = tuple(s if s is not None else o for s, o in zip(dense, old_dense, strict=True))
            dynamic = dynamic or old_dyn
            if (dense, dynamic) == self._saved:
                return
        self._saved = (dense, dynamic)
        self.store.save_catalog(SavedCatalog(self.layout, dense, dynamic).to_json())

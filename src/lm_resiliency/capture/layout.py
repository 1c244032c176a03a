"""Layout: where each tensor of a state lives inside one flat host arena.

Tensors are ordered by element size (16, 8, 4, 2, 1 bytes), then by their order
in the state, so every tensor view of the arena is naturally aligned and the
arena has no holes. The digest identifies the structure (names, dtypes, shapes,
offsets): two states with the same digest fit the same arena byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import StateSchemaError
from lm_resiliency.state.schema import TORCH_DTYPES as _DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of a dtype as stored in layouts and files (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``StateSchemaError`` for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise StateSchemaError(f"unknown dtype {name!r} in layout") from None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in the arena. ``index`` is its position in the state's tensor list."""

    index: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The arena plan for one state structure; ``specs`` are in arena (byte) order."""

    specs: tuple[TensorSpec, ...]
    total_bytes: int
    digest: str

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> Layout:
        """Plan an arena for ``tensors`` (named by ``names``, same length, unique)."""
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        meta = [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in tensors]
        return cls._plan(meta, names)

    @classmethod
    def _plan(
        cls, meta: Sequence[tuple[torch.dtype, tuple[int, ...], int]], names: Sequence[str]
    ) -> Layout:
        order = sorted(range(len(meta)), key=lambda i: (-meta[i][0].itemsize, i))
        specs = []
        offset = 0
        for i in order:
            dtype, shape, nbytes = meta[i]
            specs.append(TensorSpec(i, names[i], dtype, shape, offset, nbytes))
            offset += nbytes
        specs_t = tuple(specs)
        return cls(specs=specs_t, total_bytes=offset, digest=_digest(specs_t))

    @staticmethod
    def signature(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.dtype, torch.Size], ...]:
        """A cheap structural key: equal signatures (and names) mean the same layout."""
        return tuple((t.dtype, t.shape) for t in tensors)

    def views(self, arena: torch.Tensor) -> list[torch.Tensor]:
        """Tensor views into ``arena`` (a flat ``uint8`` tensor), in state (index) order."""
        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() < self.total_bytes:
            raise ValueError(
                f"arena must be a flat uint8 tensor of >= {self.total_bytes} bytes, "
                f"got {arena.dtype} {tuple(arena.shape)}"
            )
        out: list[torch.Tensor] = [arena] * len(self.specs)
        for s in self.specs:
            flat = arena[s.offset_bytes : s.offset_bytes + s.nbytes]
            out[s.index] = flat.view(s.dtype).view(s.shape)
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description (for wire headers and file metadata); do not mutate it.

        Built once per layout: every capture's commit record and wire header carry it.
        """
        cached: dict[str, Any] | None = self.__dict__.get("_json")
        if cached is None:
            cached = {
                "digest": self.digest,
                "total_bytes": self.total_bytes,
                "tensors": [
                    [s.index, s.name, dtype_name(s.dtype), list(s.shape), s.offset_bytes, s.nbytes]
                    for s in self.specs
                ],
            }
            object.__setattr__(self, "_json", cached)  # frozen: a cache, not a field
        return cached

    @classmethod
    def from_json(cls, doc: Any) -> Layout:
        """Rebuild and verify a layout received from a peer or a file.

        Raises ``StateSchemaError`` when the document is malformed, the offsets
        are not the canonical plan, or the digest does not match.
        """
        try:
            rows = doc["tensors"]
            if not isinstance(rows, list):
                raise TypeError("tensors is not a list")
            n = len(rows)
            meta: list[tuple[torch.dtype, tuple[int, ...], int]] = [(torch.uint8, (), 0)] * n
            names = [""] * n
            seen = set()
            for row in rows:
                index, name, dt, shape, _off, nbytes = row
                if not (isinstance(index, int) and 0 <= index < n) or index in seen:
                    raise ValueError(f"bad tensor index {index!r}")
                seen.add(index)
                if not isinstance(name, str) or not all(
                    isinstance(d, int) and d >= 0 for d in shape
                ):
                    raise ValueError(f"bad name or shape for tensor {index}")
                dtype = dtype_from_name(dt)
                numel = 1
                for d in shape:
                    numel *= d
                if nbytes != numel * dtype.itemsize:
                    raise ValueError(f"tensor {name!r}: {nbytes} bytes does not match its shape")
                meta[index] = (dtype, tuple(shape), nbytes)
                names[index] = name
            layout = cls._plan(meta, names)
        except StateSchemaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise StateSchemaError(f"malformed layout document: {exc}") from None
        if layout.to_json()["tensors"] != rows or layout.digest != doc.get("digest"):
            raise StateSchemaError(
                "layout document does not match its digest or canonical offsets "
                f"(got digest {doc.get('digest')!r}, recomputed {layout.digest!r})"
            )
        if doc.get("total_bytes") != layout.total_bytes:
            raise StateSchemaError(
                f"layout total_bytes={doc.get('total_bytes')!r} but tensors sum to "
                f"{layout.total_bytes}"
            )
        return layout


def _digest(specs: Sequence[TensorSpec]) -> str:
    rows = [[s.index, s.name, dtype_name(s.dtype), list(s.shape), s.offset_bytes] for s in specs]
    blob = json.dumps(rows, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]

"""Target: the live tensors a restore fills in place, seen as one flat byte range.

A :class:`Target` is built from a state tree of the same structure as the one
captured (the model's and optimizer's live ``state_dict()``): its tensors are
planned with the same :class:`~lm_resiliency.capture.layout.Layout`, so a
restored arena's byte ``o`` belongs to the live tensor whose spec covers ``o``
when the two layouts' digests are equal. Readers and receivers then write the
bytes straight into those tensors (memory the process already mapped) instead of
into a fresh arena whose every page faults on first touch.

Contract (the one of ``format.read_data``'s ``into``): after a failed read or
transfer (a checksum mismatch included) the target's bytes are garbage; the
restore that used it either fills it again from another source or fails.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.capture.layout import Layout
from lm_resiliency.state import encode_state


class Target:
    """Live CPU tensors laid out as a restored arena (see the module docstring)."""

    def __init__(self, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(layout.specs):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(layout.specs)}")
        self.layout = layout
        self.tensors = list(tensors)
        """In state (index) order, as given: what the restored tree holds."""
        self._starts: list[int] = []
        self._flats: list[torch.Tensor] = []
        for spec in layout.specs:
            if spec.nbytes == 0:
                continue
            flat = tensors[spec.index].detach().reshape(-1).view(torch.uint8)
            self._starts.append(spec.offset_bytes)
            self._flats.append(flat)

    @classmethod
    def from_tree(cls, tree: Any) -> Target:
        """The target of ``tree``'s tensors; raises ``ValueError`` naming an unusable one."""
        enc = encode_state(tree)
        for t, name in zip(enc.tensors, enc.names, strict=True):
            if t.device.type != "cpu" or not t.is_contiguous():
                what = f"on {t.device}" if t.device.type != "cpu" else "not contiguous"
                raise ValueError(
                    f"load(into=...): tensor {name!r} is {what}; "
                    "restoring in place needs contiguous CPU tensors (pass into=None and "
                    "copy the returned state instead)"
                )
        return cls(Layout.from_tensors(enc.tensors, enc.names), enc.tensors)

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes

    def matches(self, layout: Layout) -> bool:
        """Whether ``layout`` (of a stored or received state) fits these tensors byte for byte."""
        return layout.digest == self.layout.digest

    def pieces(self, offset: int, nbytes: int) -> list[torch.Tensor]:
        """Flat ``uint8`` views of the live tensors covering ``[offset, offset + nbytes)``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.total_bytes:
            raise ValueError(
                f"bytes [{offset}, +{nbytes}) are outside a {self.total_bytes}-byte target"
            )
        out: list[torch.Tensor] = []
        i = bisect.bisect_right(self._starts, offset) - 1
        end = offset + nbytes
        while offset < end:
            flat, start = self._flats[i], self._starts[i]
            take = min(end, start + flat.numel()) - offset
            out.append(flat[offset - start : offset - start + take])
            offset += take
            i += 1
        return out

    def piece(self, offset: int, nbytes: int) -> torch.Tensor | None:
        """The one view holding ``[offset, offset + nbytes)``, or ``None`` when it spans tensors."""
        got = self.pieces(offset, nbytes)
        return got[0] if len(got) == 1 else None

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Copy flat ``uint8`` ``data`` into the bytes from ``offset``."""
        pos = 0
        for p in self.pieces(offset, data.numel()):
            p.copy_(data[pos : pos + p.numel()])
            pos += p.numel()

"""Call signatures: the shapes and dtypes the training actually feeds each block.

A forward pre-hook on each block notes, per call, the structure of its
arguments: tensor shapes, dtypes and whether they require grad, plain scalars by
value, and the autocast state. The hook does no device work and copies nothing;
it keeps a reference to the latest *integer* tensors only (token ids,
positions), so the source peer can read their value range when it plans a
replay. Floating-point inputs are never kept.

Replays use seeded synthetic values of the recorded shapes: normal values for
floating point, uniform integers in the recorded ``[low, high)`` range (clipped
at 0, so ids index what they indexed), uniform booleans. Signatures travel
between peers as JSON (no pickle, no tensor bytes).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_SCALARS = (bool, int, float, str)
_MAX_DEPTH = 3
#: Distinct signatures counted per module (for discovered dynamic catalogs).
MAX_DISTINCT = 64


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: shape, dtype, whether it required grad, and for integers a range."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    int_range: tuple[int, int] | None = None
    """``[low, high)`` of integer values to replay (``None``: zeros; set by :func:`encode`)."""
    ref: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    """The source's latest integer tensor (local only, read when the spec is encoded)."""

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class Scalar:
    value: bool | int | float | str | None


@dataclass(frozen=True)
class Seq:
    items: tuple[ArgSpec, ...]
    kind: str  # "tuple" | "list"


ArgSpec = TensorArg | Scalar | Seq


@dataclass(frozen=True)
class CallSignature:
    """One recorded call of a block: enough to replay it on identical inputs."""

    args: tuple[ArgSpec, ...]
    kwargs: tuple[tuple[str, ArgSpec], ...]
    autocast: tuple[bool, str] = (False, "float32")
    """``(enabled, dtype name)`` of autocast for the block's device type at the call."""

    def key(self) -> str:
        """A stable text key of the signature's structure (equal calls, equal keys)."""
        return json.dumps(_to_json(self, ranges=False), sort_keys=True)

    def tensors(self) -> list[TensorArg]:
        """Every tensor argument, in argument order."""
        out: list[TensorArg] = []
        for spec in [*self.args, *(v for _, v in self.kwargs)]:
            _collect(spec, out)
        return out


class UnsupportedCall(ValueError):
    """A call whose arguments cannot be described (e.g. a dict or a custom object)."""


def _collect(spec: ArgSpec, out: list[TensorArg]) -> None:
    if isinstance(spec, TensorArg):
        out.append(spec)
    elif isinstance(spec, Seq):
        for item in spec.items:
            _collect(item, out)


def _describe(value: Any, depth: int = 0) -> ArgSpec:
    if isinstance(value, torch.Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
        ref = value.detach() if integer and value.dtype != torch.bool else None
        return TensorArg(tuple(value.shape), value.dtype, bool(value.requires_grad), None, ref)
    if value is None or isinstance(value, _SCALARS):
        return Scalar(value)
    if isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        kind = "list" if isinstance(value, list) else "tuple"
        return Seq(tuple(_describe(v, depth + 1) for v in value), kind)
    raise UnsupportedCall(f"argument of type {type(value).__name__} cannot be replayed")


def describe_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, device_type: str
) -> CallSignature:
    """The signature of one call (raises :class:`UnsupportedCall`)."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return CallSignature(
        tuple(_describe(a) for a in args),
        tuple((k, _describe(v)) for k, v in sorted(kwargs.items())),
        (bool(enabled), dtype),
    )


class Recorder:
    """Forward pre-hooks on modules that note each call's :class:`CallSignature`.

    ``last[i]`` is module ``i``'s most recent signature (``None`` until it runs,
    or an :class:`UnsupportedCall` message); with ``count_distinct``,
    ``counts[i]`` counts each distinct signature key (bounded) and
    ``examples[i]`` keeps one signature per key. ``paused`` stops recording
    (SCOUT sets it while it replays through the same hooks).

    With ``one_shot`` each module records its next call only, then its hook does
    nothing until :meth:`rearm` (SCOUT rearms after every check: one signature
    per block per check interval is all a replay needs, and the hooks cost the
    training nothing in between).
    """

    def __init__(
        self, modules: Iterable[nn.Module], *, count_distinct: bool, one_shot: bool = False
    ) -> None:
        self.modules = list(modules)
        self.count_distinct = count_distinct
        self.one_shot = one_shot
        self.armed = [True] * len(self.modules)
        self.last: list[CallSignature | str | None] = [None] * len(self.modules)
        self.counts: list[Counter[str]] = [Counter() for _ in self.modules]
        self.examples: list[dict[str, CallSignature]] = [{} for _ in self.modules]
        self.paused = False
        self._handles = [
            m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, m in enumerate(self.modules)
        ]

    def _hook(self, index: int) -> Any:
        device_type = _device_type(self.modules[index])

        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.paused or not self.armed[index]:
                return
            if self.one_shot:
                self.armed[index] = False
            try:
                sig = describe_call(args, kwargs, device_type=device_type)
            except UnsupportedCall as exc:
                self.last[index] = str(exc)
                return
            self.last[index] = sig
            if self.count_distinct:
                key = sig.key()
                counts = self.counts[index]
                if key in counts or len(counts) < MAX_DISTINCT:
                    counts[key] += 1
                    self.examples[index].setdefault(key, sig)

        return hook

    def rearm(self) -> None:
        """Record each module's next call again (``one_shot`` recorders)."""
        self.armed = [True] * len(self.modules)

    def signature(self, index: int) -> CallSignature | None:
        """Module ``index``'s most recent replayable signature, or ``None``."""
        sig = self.last[index]
        return sig if isinstance(sig, CallSignature) else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _device_type(module: nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    for b in module.buffers():
        return b.device.type
    return "cpu"


# -- wire form ------------------------------------------------------------------------


def _int_range(ref: torch.Tensor | None) -> tuple[int, int] | None:
    if ref is None or ref.numel() == 0:
        return None
    with torch.no_grad():
        lo, hi = int(ref.min()), int(ref.max())
    if hi < 0:
        return None  # nothing non-negative to imitate: replay zeros
    return max(lo, 0), hi + 1


def _spec_json(spec: ArgSpec, ranges: bool) -> Any:
    if isinstance(spec, TensorArg):
        doc: dict[str, Any] = {
            "k": "t",
            "shape": list(spec.shape),
            "dtype": str(spec.dtype).removeprefix("torch."),
            "rg": spec.requires_grad,
        }
        if ranges:
            found = spec.int_range if spec.ref is None else _int_range(spec.ref)
            doc["range"] = None if found is None else list(found)
        return doc
    if isinstance(spec, Scalar):
        return {"k": "v", "v": spec.value}
    return {"k": "s", "kind": spec.kind, "items": [_spec_json(i, ranges) for i in spec.items]}


def _to_json(sig: CallSignature, *, ranges: bool) -> dict[str, Any]:
    return {
        "args": [_spec_json(a, ranges) for a in sig.args],
        "kwargs": [[k, _spec_json(v, ranges)] for k, v in sig.kwargs],
        "autocast": list(sig.autocast),
    }


def encode(sig: CallSignature) -> dict[str, Any]:
    """The JSON form of ``sig``, integer ranges read from the kept tensors (may synchronize)."""
    return _to_json(sig, ranges=True)


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a replay signature")
    return value


def _spec_from(doc: Any) -> ArgSpec:
    kind = doc["k"]
    if kind == "t":
        found = doc.get("range")
        rng = None if found is None else (int(found[0]), int(found[1]))
        return TensorArg(
            tuple(int(s) for s in doc["shape"]), _dtype(doc["dtype"]), bool(doc["rg"]), rng
        )
    if kind == "v":
        return Scalar(doc["v"])
    if kind == "s":
        return Seq(tuple(_spec_from(i) for i in doc["items"]), str(doc["kind"]))
    raise ValueError(f"unknown argument kind {kind!r} in a replay signature")


def decode(doc: dict[str, Any]) -> CallSignature:
    """The inverse of :func:`encode`."""
    enabled, dtype = doc["autocast"]
    return CallSignature(
        tuple(_spec_from(a) for a in doc["args"]),
        tuple((str(k), _spec_from(v)) for k, v in doc["kwargs"]),
        (bool(enabled), str(dtype)),
    )

"""Call signatures: the shapes and dtypes the training actually feeds each block.

A forward pre-hook on each block notes, per call, the structure of its
arguments: tensor shapes, dtypes and whether they require grad, plain scalars by
value, and the autocast state. Only integer tensors (token ids, positions) up to
a size bound are kept by reference, so the source peer can broadcast the exact
values; floating-point inputs are never kept (replays use seeded synthetic
values of the recorded shape). The hook does no device work and no copy.

Signatures travel between peers as JSON plus the raw bytes of kept integer
tensors (:func:`encode` / :func:`decode`); no pickle.
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
    """A tensor argument: its shape, dtype, whether it required grad, kept integer values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    data: torch.Tensor | None = field(default=None, compare=False, hash=False)
    """Integer values kept by the source peer (``None``: zeros of the shape are replayed)."""

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
        """A stable text key of the signature without kept values (equal calls, equal keys)."""
        return json.dumps(_to_json(self, None), sort_keys=True)

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


def _describe(value: Any, keep_int_bytes: int, depth: int = 0) -> ArgSpec:
    if isinstance(value, torch.Tensor):
        data = None
        integer = not value.dtype.is_floating_point and not value.dtype.is_complex
        if integer and value.numel() * value.element_size() <= keep_int_bytes:
            data = value.detach()
        return TensorArg(tuple(value.shape), value.dtype, bool(value.requires_grad), data)
    if value is None or isinstance(value, _SCALARS):
        return Scalar(value)
    if isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        kind = "list" if isinstance(value, list) else "tuple"
        return Seq(tuple(_describe(v, keep_int_bytes, depth + 1) for v in value), kind)
    raise UnsupportedCall(f"argument of type {type(value).__name__} cannot be replayed")


def describe_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, device_type: str, keep_int_bytes: int
) -> CallSignature:
    """The signature of one call (raises :class:`UnsupportedCall`)."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return CallSignature(
        tuple(_describe(a, keep_int_bytes) for a in args),
        tuple((k, _describe(v, keep_int_bytes)) for k, v in sorted(kwargs.items())),
        (bool(enabled), dtype),
    )


class Recorder:
    """Forward pre-hooks on modules that note each call's :class:`CallSignature`.

    ``last[i]`` is module ``i``'s most recent signature (``None`` until it runs,
    or an :class:`UnsupportedCall` message), ``counts[i]`` how often each
    distinct signature key was seen (bounded). :meth:`paused` stops recording
    while SCOUT replays through the same hooks.
    """

    def __init__(
        self, modules: Iterable[nn.Module], *, keep_int_bytes: int, count_distinct: bool
    ) -> None:
        self.modules = list(modules)
        self.keep_int_bytes = keep_int_bytes
        self.count_distinct = count_distinct
        self.last: list[CallSignature | str | None] = [None] * len(self.modules)
        self.counts: list[Counter[str]] = [Counter() for _ in self.modules]
        self.examples: list[dict[str, CallSignature]] = [{} for _ in self.modules]
        self.paused = False
        self._handles = [
            m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, m in enumerate(self.modules)
        ]

    def _hook(self, index: int) -> Any:
        module = self.modules[index]
        device_type = _device_type(module)

        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.paused:
                return
            try:
                sig = describe_call(
                    args, kwargs, device_type=device_type, keep_int_bytes=self.keep_int_bytes
                )
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


def _spec_json(spec: ArgSpec, blobs: list[bytes] | None) -> Any:
    if isinstance(spec, TensorArg):
        doc: dict[str, Any] = {
            "k": "t",
            "shape": list(spec.shape),
            "dtype": str(spec.dtype).removeprefix("torch."),
            "rg": spec.requires_grad,
        }
        if blobs is not None and spec.data is not None:
            raw = spec.data.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            doc["data"] = len(blobs)
            blobs.append(raw)
        return doc
    if isinstance(spec, Scalar):
        return {"k": "v", "v": spec.value}
    return {"k": "s", "kind": spec.kind, "items": [_spec_json(i, blobs) for i in spec.items]}


def _to_json(sig: CallSignature, blobs: list[bytes] | None) -> dict[str, Any]:
    return {
        "args": [_spec_json(a, blobs) for a in sig.args],
        "kwargs": [[k, _spec_json(v, blobs)] for k, v in sig.kwargs],
        "autocast": list(sig.autocast),
    }


def encode(sig: CallSignature) -> tuple[dict[str, Any], list[bytes]]:
    """JSON document and the raw bytes of kept integer tensors (indexed by ``data``)."""
    blobs: list[bytes] = []
    return _to_json(sig, blobs), blobs


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a replay signature")
    return value


def _spec_from(doc: Any, blobs: list[bytes]) -> ArgSpec:
    kind = doc["k"]
    if kind == "t":
        dtype = _dtype(doc["dtype"])
        shape = tuple(int(s) for s in doc["shape"])
        data = None
        if doc.get("data") is not None:
            raw = bytearray(blobs[int(doc["data"])])
            data = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        return TensorArg(shape, dtype, bool(doc["rg"]), data)
    if kind == "v":
        return Scalar(doc["v"])
    if kind == "s":
        return Seq(tuple(_spec_from(i, blobs) for i in doc["items"]), str(doc["kind"]))
    raise ValueError(f"unknown argument kind {kind!r} in a replay signature")


def decode(doc: dict[str, Any], blobs: list[bytes]) -> CallSignature:
    """The inverse of :func:`encode`."""
    enabled, dtype = doc["autocast"]
    return CallSignature(
        tuple(_spec_from(a, blobs) for a in doc["args"]),
        tuple((str(k), _spec_from(v, blobs)) for k, v in doc["kwargs"]),
        (bool(enabled), str(dtype)),
    )

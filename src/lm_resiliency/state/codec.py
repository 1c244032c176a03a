"""Encode a state tree into tensors plus a JSON document, and decode it back.

``encode_state`` runs on the training thread at every capture, so it walks the
tree once, references tensors by index without copying them, and skips the
JSON round trip a validation would cost: it enforces the same rules as the
reader in :mod:`lm_resiliency.state.schema` while it builds the document, so
what it produces always validates. ``decode_state`` trusts nothing and
validates while it rebuilds.
"""

from __future__ import annotations

import base64
import enum
import struct
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from lm_resiliency.errors import StateEncodingError
from lm_resiliency.state.limits import DEFAULT_LIMITS, DocumentLimits
from lm_resiliency.state.schema import (
    DEVICE_PATTERN,
    NP_DTYPE_PATTERN,
    SCHEMA_VERSION,
    dumps_document,
    read_document,
)

# Values inside these bounds need no further checks on the hot path: a short
# ASCII string and an int below 2**63 both fit in the per-item JSON budget.
_SHORT_STR = 32
_I63 = 2**63
# An upper bound on the JSON bytes one value adds besides its long strings and
# big ints (structure, separators, a number, a short string, a node tag).
_ITEM_JSON_BOUND = 256
_SUPPORTED = (
    "None, bool, int, float, str, bytes, list, tuple, dict, OrderedDict, torch.Tensor, "
    "torch.dtype, torch.device, torch.Size, NumPy arrays and scalars"
)


@dataclass(frozen=True)
class EncodedState:
    """A state tree split into tensors and a JSON document.

    ``document`` is JSON-serializable (plain ``json.dumps`` works, no NaN
    needed) and valid under the schema. ``tensors`` are the tree's unique
    tensors in first-seen order, not copied: the same tensor, or an alias with
    identical storage pointer, dtype, shape, stride, offset and device (tied
    weights), appears once. ``names[i]`` is the first key path of
    ``tensors[i]`` joined by ``/`` (``"optimizer/state/0/exp_avg"``), made
    unique with a ``#n`` suffix on collision.
    """

    document: dict[str, Any]
    tensors: list[torch.Tensor]
    names: list[str]


class Deferred:
    """Marks a dict subtree whose walk :func:`begin_encoding` may leave for later.

    For subtrees whose non-tensor values are already a snapshot (fresh dicts
    of immutable values, as ``state_dict()`` methods build) and whose tensors
    keep their shape until the capture's copy is done: walking them later, on
    another thread, reads the same thing. :func:`encode_state` walks it at once.

    ``value`` may also be a function of no arguments that returns the dict: it is
    called where the walk happens (later, on the capture worker, for
    :func:`begin_encoding`), so building the subtree leaves the caller's thread
    too. It must then read only what does not change until the capture's copy
    is done (parameters and optimizer state, which change in ``optimizer.step()``).
    """

    __slots__ = ("value",)

    def __init__(self, value: Mapping[Any, Any] | Callable[[], Mapping[Any, Any]]) -> None:
        self.value = value

    def resolve(self) -> Mapping[Any, Any]:
        """The subtree (calls ``value`` when it is a function)."""
        value = self.value
        return value() if callable(value) else value


class PartialEncoding:
    """A tree encoded except for its :class:`Deferred` subtrees; :meth:`finish` walks them.

    ``finish`` may run on another thread (once); it raises ``StateEncodingError``
    like :func:`encode_state` would have.
    """

    def __init__(self, enc: _Encoder, root: Any) -> None:
        self._enc = enc
        self._root = root

    def finish(self) -> EncodedState:
        enc = self._enc
        holes, enc.holes = enc.holes, []
        enc.defer = False
        for node, hole, pre, depth in holes:
            filled = enc.value(hole.resolve(), pre, depth)
            if not isinstance(filled, dict):
                raise TypeError(f"Deferred at {_where(pre)!r} must wrap a dict")
            node.update(filled)
        return _document(enc, self._root)


def encode_state(tree: Any, *, limits: DocumentLimits = DEFAULT_LIMITS) -> EncodedState:
    """Flatten ``tree`` (nested dict/list/tuple of tensors and plain values).

    Call at capture time on the thread that owns the state; cost grows with
    the number of values, not with tensor bytes. Raises
    ``StateEncodingError`` naming the key path, the type and a fix when a value
    is not supported or the tree exceeds ``limits``.
    """
    enc = _Encoder(limits)
    return _document(enc, enc.value(tree, "", 0))


def begin_encoding(tree: Any, *, limits: DocumentLimits = DEFAULT_LIMITS) -> PartialEncoding:
    """Encode ``tree`` now except its :class:`Deferred` subtrees (walked by ``finish()``).

    The tensors of the part walked now come first in the tensor list; an alias
    met later (tied weights) still resolves to the first entry.
    """
    enc = _Encoder(limits)
    enc.defer = True
    return PartialEncoding(enc, enc.value(tree, "", 0))


def _document(enc: _Encoder, root: Any) -> EncodedState:
    limits = enc.limits
    doc = {"schema": SCHEMA_VERSION, "tensor_count": len(enc.tensors), "root": root}
    if enc.items * _ITEM_JSON_BOUND + enc.extra_bytes > limits.max_bytes:
        # Rare: only states near the limit pay for the exact measurement.
        nbytes = len(dumps_document(doc).encode("utf-8"))
        if nbytes > limits.max_bytes:
            raise StateEncodingError(
                f"state document would be {nbytes} bytes of JSON, over DocumentLimits.max_bytes="
                f"{limits.max_bytes}; move large non-tensor values into tensors"
            )
    return EncodedState(document=doc, tensors=enc.tensors, names=enc.names)


def decode_state(
    document: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    *,
    limits: DocumentLimits = DEFAULT_LIMITS,
) -> Any:
    """Rebuild the tree encoded in ``document`` using ``tensors``.

    ``tensors`` are in ``EncodedState.tensors`` order (arena views or loaded
    tensors) and are placed in the tree as given, not copied; a tensor
    referenced twice (tied weights) decodes to one shared object. Validates the
    whole document and the tensor count first; raises ``StateSchemaError``
    naming the key path when anything is malformed, and returns nothing partial.
    """
    return read_document(document, tensors, None, limits)


def _where(pre: str) -> str:
    text = pre[:-1] or "<root>"
    return text if len(text) <= 300 else f"{text[:140]}...{text[-140:]}"


def _special_float(x: float) -> dict[str, Any]:
    return {"k": "float", "bits": struct.pack(">d", x).hex()}


class _Encoder:
    """One walk over a tree. ``pre`` arguments are a value's key path plus ``/``
    (``""`` for the root): building it only for containers and tensors keeps
    plain leaves free of string work."""

    def __init__(self, limits: DocumentLimits) -> None:
        self.limits = limits
        self.items = 1
        self.extra_bytes = 0
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.name_set: set[str] = set()
        # (data_ptr, dtype, shape, stride, offset, device) -> index, so tied weights
        # (distinct detach() views of one parameter) share one entry; id() otherwise.
        self.by_key: dict[Any, int] = {}
        self.defer = False
        self.holes: list[tuple[dict[str, Any], Deferred, str, int]] = []

    # -- errors and limits -------------------------------------------------
    def fail(self, pre: str, problem: str) -> NoReturn:
        raise StateEncodingError(f"cannot encode state at {_where(pre)!r}: {problem}")

    def unsupported(self, x: Any, pre: str) -> NoReturn:
        t = type(x)
        name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        self.fail(pre, f"type {name} is not supported ({_SUPPORTED}); {_hint(x)}")

    def enter(self, pre: str, depth: int, count: int) -> None:
        if depth + 1 > self.limits.max_depth:
            self.fail(
                pre,
                f"containers nest deeper than DocumentLimits.max_depth={self.limits.max_depth} "
                "(is there a reference cycle?)",
            )
        self.items += count
        if self.items > self.limits.max_items:
            self.fail(
                pre,
                f"more than DocumentLimits.max_items={self.limits.max_items} values; "
                "move bulk data into tensors",
            )

    def long_str(self, s: str, pre: str, what: str = "string") -> None:
        if s.isascii():
            nbytes = len(s)
        else:
            try:
                nbytes = len(s.encode("utf-8"))
            except UnicodeEncodeError:
                self.fail(pre, f"{what} contains a lone surrogate and is not UTF-8 text")
        if nbytes > self.limits.max_string_bytes:
            self.fail(
                pre,
                f"{what} of {nbytes} bytes exceeds DocumentLimits.max_string_bytes="
                f"{self.limits.max_string_bytes}; store bulk data as a tensor",
            )
        self.extra_bytes += 6 * len(s) + 2

    def big_int(self, x: int, pre: str) -> None:
        bits = x.bit_length()
        if bits > self.limits.max_int_bits:
            self.fail(
                pre,
                f"int of {bits} bits exceeds DocumentLimits.max_int_bits="
                f"{self.limits.max_int_bits}",
            )
        self.extra_bytes += bits // 3 + 2

    def blob(self, text: str, pre: str, what: str) -> str:
        if len(text) > self.limits.max_string_bytes:
            self.fail(
                pre,
                f"{what} needs {len(text)} bytes of text, over DocumentLimits.max_string_bytes="
                f"{self.limits.max_string_bytes}; pass it as a torch tensor instead",
            )
        self.extra_bytes += len(text)
        return text

    # -- values --------------------------------------------------------------
    def value(self, x: Any, pre: str, depth: int) -> Any:
        t = type(x)
        handler = _HANDLERS.get(t)
        if handler is not None:
            return handler(self, x, pre, depth)
        if x is None or t is bool:
            return x
        if t is int:
            if not -_I63 <= x < _I63:
                self.big_int(x, pre)
            return x
        if t is float:
            return x if x - x == 0.0 else _special_float(x)
        if t is str:
            if not x.isascii() or len(x) > _SHORT_STR:
                self.long_str(x, pre)
            return x
        if isinstance(x, np.generic):
            return self.npscalar(x, pre)
        self.unsupported(x, pre)

    def seq(self, v: list[Any] | tuple[Any, ...], pre: str, depth: int) -> list[Any]:
        self.enter(pre, depth, len(v))
        if v and set(map(type, v)) == {int}:
            # Fast path for RNG states and parameter index lists.
            if min(v) < -_I63 or max(v) >= _I63:
                for i, x in enumerate(v):
                    if not -_I63 <= x < _I63:
                        self.big_int(x, f"{pre}{i}/")
            return list(v)
        out = []
        for i, x in enumerate(v):
            t = type(x)
            if t is float:
                out.append(x if x - x == 0.0 else _special_float(x))
            elif (
                (t is str and len(x) <= _SHORT_STR and x.isascii())
                or (t is int and -_I63 <= x < _I63)
                or t is bool
                or x is None
            ):  # stored as is, no check needed
                out.append(x)
            elif t is _Tensor:
                out.append({"k": "tensor", "i": self.tensor_index(x, pre, i)})
            else:
                out.append(self.value(x, f"{pre}{i}/", depth + 1))
        return out

    def list_(self, v: list[Any], pre: str, depth: int) -> Any:
        return self.seq(v, pre, depth)

    def tuple_(self, v: tuple[Any, ...], pre: str, depth: int) -> Any:
        return {"k": "tuple", "v": self.seq(v, pre, depth)}

    def mapping(self, v: dict[Any, Any], pre: str, depth: int, kind: str) -> dict[str, Any]:
        self.enter(pre, depth, 2 * len(v))
        str_keys = True
        vals = []
        for k, x in v.items():
            if type(k) is str:
                if len(k) > _SHORT_STR or not k.isascii():
                    self.long_str(k, f"{pre}{k}/", "dict key")
            else:
                str_keys = False
            t = type(x)
            if t is _Tensor:
                vals.append({"k": "tensor", "i": self.tensor_index(x, pre, k)})
            elif t is float:
                vals.append(x if x - x == 0.0 else _special_float(x))
            elif (
                (t is str and len(x) <= _SHORT_STR and x.isascii())
                or (t is int and -_I63 <= x < _I63)
                or t is bool
                or x is None
            ):  # stored as is, no check needed
                vals.append(x)
            elif t is dict:
                vals.append(self.mapping(x, f"{pre}{k}/", depth + 1, "dict"))
            else:
                vals.append(self.value(x, f"{pre}{k}/", depth + 1))
        if str_keys:
            return {"k": kind, "v": dict(zip(v, vals, strict=True))}
        items = []
        for k, e in zip(v, vals, strict=True):
            t = type(k)
            if (t is int and -_I63 <= k < _I63) or t is str:  # str keys were checked above
                items.append([k, e])
            else:
                items.append([self.key(k, f"{pre}{k}/", depth + 1), e])
        return {"k": kind, "items": items}

    def dict_(self, v: dict[Any, Any], pre: str, depth: int) -> Any:
        return self.mapping(v, pre, depth, "dict")

    def odict(self, v: OrderedDict[Any, Any], pre: str, depth: int) -> Any:
        node = self.mapping(v, pre, depth, "odict")
        # nn.Module.state_dict() keeps per-module versions here; load_state_dict reads them.
        meta = getattr(v, "_metadata", None)
        if meta is not None:
            self.enter(pre, depth, 1)
            node["meta"] = self.value(meta, f"{pre}_metadata/", depth + 1)
        return node

    def key(self, k: Any, pre: str, depth: int) -> Any:
        t = type(k)
        if t is tuple:
            self.enter(pre, depth, len(k))
            return {"k": "tuple", "v": [self.key(e, pre, depth + 1) for e in k]}
        if t in _KEY_TYPES or isinstance(k, np.generic):
            return self.value(k, pre, depth)
        t_name = type(k).__qualname__
        self.fail(
            pre,
            f"dict key of type {t_name} is not supported; dict keys must be None, bool, int, "
            "float, str, bytes, torch.dtype/device/Size, NumPy scalars or tuples of these",
        )

    def tensor(self, x: torch.Tensor, pre: str, depth: int) -> Any:
        return {"k": "tensor", "i": self.tensor_index(x, pre, _OWN_PATH)}

    def tensor_index(self, x: torch.Tensor, pre: str, k: Any) -> int:
        """Index of ``x``, the value at key ``k`` under ``pre`` (``_OWN_PATH``: at ``pre``)."""
        key: Any = None  # sparse, mkldnn or nested tensors raise below and are rejected
        dense = False
        try:
            ptr = x.data_ptr()
            if ptr:
                dt = x.dtype
                key = (ptr, dt, x.shape, x.stride(), x.storage_offset(), x.device)
                dense = dt not in _QUANTIZED
            else:
                key = id(x)  # no storage (empty or meta): pointers say nothing about aliasing
        except (RuntimeError, NotImplementedError):
            pass
        idx = self.by_key.get(key)
        if idx is not None:
            return idx
        name = (pre[:-1] or "<root>") if k is _OWN_PATH else f"{pre}{k}"
        if not dense or x.layout is not _STRIDED:
            self.check_tensor(x, f"{name}/")
        idx = len(self.tensors)
        self.tensors.append(x)
        if name in self.name_set:
            n = 2
            while f"{name}#{n}" in self.name_set:
                n += 1
            name = f"{name}#{n}"
        self.name_set.add(name)
        self.names.append(name)
        self.by_key[key] = idx
        return idx

    def check_tensor(self, x: torch.Tensor, pre: str) -> None:
        if x.layout is not torch.strided or x.is_nested:
            kind = "nested" if x.is_nested else str(x.layout).removeprefix("torch.")
            self.fail(
                pre,
                f"{kind} torch.Tensor is not supported, only dense (strided) tensors are; "
                "convert it with .to_dense() or store its parts as dense tensors",
            )
        if x.dtype in _QUANTIZED:
            self.fail(
                pre,
                f"quantized torch.Tensor ({x.dtype}) is not supported; store .dequantize(), "
                "or .int_repr() with the scale and zero point as plain values",
            )
        if x.is_meta:
            self.fail(
                pre,
                "meta torch.Tensor is not supported: it holds no data; materialize the "
                "module (e.g. to_empty() and initialization) before capturing",
            )

    def np_dtype(self, dt: np.dtype[Any], x: Any, pre: str) -> str:
        s: str = dt.str
        scalar = isinstance(x, np.generic)
        if dt.hasobject or (dt.itemsize == 0 and not scalar) or not NP_DTYPE_PATTERN.fullmatch(s):
            kind = "NumPy scalar" if scalar else "numpy.ndarray"
            self.fail(
                pre,
                f"{kind} with dtype {dt.str!r} is not supported (object, record and empty "
                "dtypes are not); convert it to a numeric or string dtype, or to a list",
            )
        return s

    def ndarray(self, a: np.ndarray[Any, Any], pre: str, depth: int) -> Any:
        dtype = self.np_dtype(a.dtype, a, pre)
        if a.ndim > 32:
            self.fail(pre, f"NumPy array has {a.ndim} dimensions, over the supported 32")
        text = self.blob(base64.b64encode(a.tobytes()).decode("ascii"), pre, "NumPy array")
        self.extra_bytes += 21 * a.ndim
        return {"k": "ndarray", "dtype": dtype, "shape": list(a.shape), "b64": text}

    def npscalar(self, x: np.generic, pre: str) -> Any:
        dtype = self.np_dtype(x.dtype, x, pre)
        return {
            "k": "npscalar",
            "dtype": dtype,
            # NumPy pads an empty string scalar's tobytes() to one character.
            "hex": self.blob(x.tobytes()[: x.dtype.itemsize].hex(), pre, "NumPy scalar"),
        }

    def deferred(self, x: Deferred, pre: str, depth: int) -> Any:
        if not self.defer:
            return self.value(x.resolve(), pre, depth)
        node: dict[str, Any] = {}
        self.holes.append((node, x, pre, depth))
        return node

    def bytes_(self, x: bytes, pre: str, depth: int) -> Any:
        return {"k": "bytes", "b64": self.blob(base64.b64encode(x).decode("ascii"), pre, "bytes")}

    def dtype(self, x: torch.dtype, pre: str, depth: int) -> Any:
        return {"k": "dtype", "v": str(x).removeprefix("torch.")}

    def device(self, x: torch.device, pre: str, depth: int) -> Any:
        name = str(x)
        if not DEVICE_PATTERN.fullmatch(name):
            self.fail(pre, f"torch.device {name!r} has no portable name; store it as a str")
        return {"k": "device", "v": name}

    def size(self, x: torch.Size, pre: str, depth: int) -> Any:
        if len(x) > 64:
            self.fail(pre, f"torch.Size has {len(x)} dimensions, over the supported 64")
        self.extra_bytes += 21 * len(x)
        return {"k": "size", "v": list(x)}


def _hint(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return (
            f"tensor subclass {type(x).__name__} is not supported; pass a plain tensor "
            "(for DTensor use .to_local() or .full_tensor())"
        )
    if isinstance(x, (set, frozenset)):
        return "convert the set to a sorted list or tuple"
    if isinstance(
        x, (types.FunctionType, types.LambdaType, types.MethodType, types.BuiltinFunctionType)
    ):
        return "callables cannot be captured; store the data they use as plain values"
    if isinstance(x, enum.Enum):
        return "store the member's .value (or .name) instead"
    if isinstance(x, np.ndarray):
        return "convert it with np.asarray(...) to a plain ndarray"
    if isinstance(x, tuple):
        return "convert it with tuple(...) (for a namedtuple, ._asdict())"
    for base in (dict, list, str, int, float):
        if isinstance(x, base):
            return f"convert it to a plain {base.__name__} with {base.__name__}(...)"
    if isinstance(x, (bytearray, memoryview)):
        return "convert it with bytes(...)"
    return (
        "convert it to a supported type, or pass it through extra_state "
        "(state_dict()/extra_state_fn) as plain values"
    )


_Tensor = torch.Tensor
_STRIDED = torch.strided
_OWN_PATH = object()
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_KEY_TYPES = frozenset(
    {str, int, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size}
)
_HANDLERS: dict[type, Callable[[_Encoder, Any, str, int], Any]] = {
    torch.Tensor: _Encoder.tensor,
    torch.nn.Parameter: _Encoder.tensor,
    dict: _Encoder.dict_,
    OrderedDict: _Encoder.odict,
    list: _Encoder.list_,
    tuple: _Encoder.tuple_,
    bytes: _Encoder.bytes_,
    torch.dtype: _Encoder.dtype,
    torch.device: _Encoder.device,
    torch.Size: _Encoder.size,
    np.ndarray: _Encoder.ndarray,
    Deferred: _Encoder.deferred,
}

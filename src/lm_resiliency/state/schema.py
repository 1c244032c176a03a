"""The versioned JSON schema of a state document, and its validating reader.

A document is ``{"schema": SCHEMA_VERSION, "tensor_count": N, "root": NODE}``.
A NODE is either a bare JSON value or a tagged object ``{"k": KIND, ...}``:

===========  ==============================================  ==========================
JSON / kind  fields                                          decodes to
===========  ==============================================  ==========================
null/bool    (bare)                                          ``None`` / ``bool``
number       (bare) int, or finite float                     ``int`` / ``float``
string       (bare)                                          ``str``
array        (bare) NODEs                                    ``list``
``tuple``    ``v``: NODEs                                    ``tuple``
``dict``     ``v``: {str: NODE} or ``items``: [[KEY, NODE]]  ``dict`` (order kept)
``odict``    as ``dict``, optional ``meta``: NODE            ``OrderedDict`` (+``_metadata``)
``float``    ``bits``: 16 hex digits (IEEE-754, big endian)  non-finite ``float``
``bytes``    ``b64``                                         ``bytes``
``tensor``   ``i``: index into the tensor list               ``torch.Tensor``
``ndarray``  ``dtype`` (NumPy ``dtype.str``), ``shape``,     ``numpy.ndarray``
             ``b64`` (C-order bytes)
``npscalar`` ``dtype``, ``hex`` (the scalar's bytes)         NumPy scalar
``dtype``    ``v``: name such as ``"float32"``               ``torch.dtype``
``device``   ``v``: such as ``"cuda:0"``                     ``torch.device``
``size``     ``v``: ints                                     ``torch.Size``
===========  ==============================================  ==========================

A KEY is a NODE that decodes to a hashable value (no list, dict, tensor or
array). The reader here is the only way a document becomes a tree: validating
and decoding are the same walk, so a document that validates always decodes.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from lm_resiliency.errors import StateSchemaError
from lm_resiliency.state.limits import DEFAULT_LIMITS, DocumentLimits

SCHEMA_VERSION = "lm_resiliency.state/1"

TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}

# NumPy dtype strings we accept: byte order, a kind without Python objects or
# structured records, item size, optional datetime unit.
NP_DTYPE_PATTERN = re.compile(r"[<>|=][biufcSUmM][0-9]{1,9}(\[[0-9]*[A-Za-z]{1,2}\])?")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
DEVICE_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}(:[0-9]{1,6})?")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Path = tuple[str, ...]


def dumps_document(document: Mapping[str, Any]) -> str:
    """The compact JSON text of a document (what ``DocumentLimits.max_bytes`` measures)."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def loads_document(text: str | bytes, *, limits: DocumentLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Parse JSON text into a document without trusting it.

    Checks the text's size before parsing; the result still has to pass
    :func:`validate_document` (``decode_state`` does that). Raises
    ``StateSchemaError`` for oversized, non-UTF-8, non-JSON or non-object text.
    """
    nbytes = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if nbytes > limits.max_bytes:
        raise StateSchemaError(
            f"state document is {nbytes} bytes, over DocumentLimits.max_bytes={limits.max_bytes}"
        )

    def _no_constants(name: str) -> NoReturn:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        doc = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise StateSchemaError(f"state document is not valid JSON: {exc}") from None
    if type(doc) is not dict:
        raise StateSchemaError(f"state document must be a JSON object, got {type(doc).__name__}")
    return doc


def validate_document(
    document: Any, *, tensor_count: int | None = None, limits: DocumentLimits = DEFAULT_LIMITS
) -> None:
    """Check that ``document`` is a well-formed state document within ``limits``.

    Call on any document that came from another process or a file before using
    it (``decode_state`` does). ``tensor_count``, when given, must equal the
    document's. Raises ``StateSchemaError`` naming the key path and the problem;
    never raises anything else for any input.
    """
    read_document(document, None, tensor_count, limits)


def read_document(
    document: Any,
    tensors: Sequence[torch.Tensor] | None,
    tensor_count: int | None,
    limits: DocumentLimits,
) -> Any:
    """Validate ``document`` and rebuild its tree (tensor nodes become ``tensors[i]``,
    or ``None`` when ``tensors`` is ``None``). Raises ``StateSchemaError`` only."""
    try:
        return _Reader(limits, tensors).document(document, tensor_count)
    except RecursionError:
        # Backstop only: the depth limit keeps walks far shallower than this.
        raise StateSchemaError("state document nests too deeply to read") from None


def _where(path: Path) -> str:
    text = "/".join(path) if path else "<root>"
    return text if len(text) <= 300 else f"{text[:140]}...{text[-140:]}"


def _brief(value: Any) -> str:
    """``repr`` cut to a readable length: documents may hold megabyte strings."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} chars)"


class _Reader:
    def __init__(self, limits: DocumentLimits, tensors: Sequence[torch.Tensor] | None) -> None:
        self.limits = limits
        self.tensors = tensors
        self.count = 0
        self.items = 1
        self.used: set[int] = set()

    def fail(self, path: Path, problem: str) -> NoReturn:
        raise StateSchemaError(f"invalid state document at {_where(path)!r}: {problem}")

    def document(self, doc: Any, tensor_count: int | None) -> Any:
        if not isinstance(doc, Mapping):
            raise StateSchemaError(
                f"state document must be a JSON object, got {type(doc).__name__}"
            )
        self.fields(doc, (), "document", ("schema", "tensor_count", "root"))
        if doc["schema"] != SCHEMA_VERSION:
            raise StateSchemaError(
                f"unsupported state schema {_brief(doc['schema'])}; this version reads "
                f"{SCHEMA_VERSION!r} only (node-local files are not a cross-version format)"
            )
        count = doc["tensor_count"]
        if type(count) is not int or not 0 <= count <= self.limits.max_items:
            self.fail(
                (),
                f"tensor_count must be an int in [0, {self.limits.max_items}], got {_brief(count)}",
            )
        if tensor_count is not None and count != tensor_count:
            raise StateSchemaError(
                f"state document references {count} tensors but {tensor_count} were given"
            )
        if self.tensors is not None:
            if len(self.tensors) != count:
                raise StateSchemaError(
                    f"state document references {count} tensors but {len(self.tensors)} were given"
                )
            for i, t in enumerate(self.tensors):
                if not isinstance(t, torch.Tensor):
                    raise StateSchemaError(f"tensors[{i}] is a {type(t).__name__}, not a tensor")
        self.count = count
        root = self.node(doc["root"], (), 0, False)
        if len(self.used) != count:
            missing = min(set(range(count)) - self.used)
            self.fail((), f"tensor {missing} of {count} is never referenced")
        try:
            nbytes = len(dumps_document(dict(doc)).encode("utf-8"))
        except (TypeError, ValueError) as exc:  # e.g. a top-level key that is not a str
            raise StateSchemaError(f"state document is not JSON-serializable: {exc}") from None
        if nbytes > self.limits.max_bytes:
            raise StateSchemaError(
                f"state document is {nbytes} bytes of JSON, over DocumentLimits.max_bytes="
                f"{self.limits.max_bytes}"
            )
        return root

    def fields(
        self,
        n: Mapping[str, Any],
        path: Path,
        kind: str,
        required: tuple[str, ...],
        optional: tuple[str, ...] = (),
    ) -> None:
        missing = [f for f in required if f not in n]
        if missing:
            self.fail(path, f"{kind!r} node is missing field(s) {missing}")
        extra = [f for f in n if f != "k" and f not in required and f not in optional]
        if extra:
            self.fail(
                path, f"{kind!r} node has unexpected field(s) {_brief(sorted(map(str, extra)))}"
            )

    def enter(self, path: Path, depth: int, count: int) -> None:
        if depth + 1 > self.limits.max_depth:
            self.fail(
                path,
                f"containers nest deeper than DocumentLimits.max_depth={self.limits.max_depth}",
            )
        self.items += count
        if self.items > self.limits.max_items:
            self.fail(path, f"more than DocumentLimits.max_items={self.limits.max_items} values")

    def string(self, s: Any, path: Path, what: str) -> str:
        if type(s) is not str:
            self.fail(path, f"{what} must be a string, got {type(s).__name__}")
        limit = self.limits.max_string_bytes
        if not s.isascii():
            try:
                nbytes = len(s.encode("utf-8"))
            except UnicodeEncodeError:
                self.fail(path, f"{what} is not valid UTF-8 text (lone surrogate)")
        else:
            nbytes = len(s)
        if nbytes > limit:
            self.fail(
                path, f"{what} is {nbytes} bytes, over DocumentLimits.max_string_bytes={limit}"
            )
        return s

    def integer(
        self, v: Any, path: Path, what: str, lo: int | None = None, hi: int | None = None
    ) -> int:
        if type(v) is not int:
            self.fail(path, f"{what} must be an int, got {type(v).__name__}")
        if v.bit_length() > self.limits.max_int_bits:
            self.fail(
                path,
                f"{what} has {v.bit_length()} bits, over DocumentLimits.max_int_bits="
                f"{self.limits.max_int_bits}",
            )
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            self.fail(path, f"{what}={v} is outside [{lo}, {hi}]")
        return v

    def node(self, n: Any, path: Path, depth: int, key: bool) -> Any:
        t = type(n)
        if n is None or t is bool:
            return n
        if t is int:
            return self.integer(n, path, "int value")
        if t is float:
            if n - n != 0.0:
                self.fail(path, "bare float must be finite (non-finite floats use kind 'float')")
            return n
        if t is str:
            return self.string(n, path, "string value")
        if t is list:
            if key:
                self.fail(path, "a list cannot be a dict key")
            self.enter(path, depth, len(n))
            return [self.node(e, (*path, str(i)), depth + 1, False) for i, e in enumerate(n)]
        if t is not dict:
            self.fail(path, f"value of type {t.__name__} is not JSON")
        kind = n.get("k")
        handler = _KINDS.get(kind) if type(kind) is str else None
        if handler is None:
            self.fail(path, f"unknown node kind {_brief(kind)}; known: {sorted(_KINDS)}")
        return handler(self, n, path, depth, key)

    def tuple_(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.fields(n, path, "tuple", ("v",))
        v = n["v"]
        if type(v) is not list:
            self.fail(path, f"'tuple' field 'v' must be a list, got {type(v).__name__}")
        self.enter(path, depth, len(v))
        return tuple(self.node(e, (*path, str(i)), depth + 1, key) for i, e in enumerate(v))

    def dict_(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        kind = n["k"]
        if key:
            self.fail(path, f"a {kind!r} cannot be a dict key")
        has_v, has_items = "v" in n, "items" in n
        if has_v == has_items:
            self.fail(path, f"{kind!r} node needs exactly one of fields 'v' and 'items'")
        self.fields(
            n, path, kind, ("v",) if has_v else ("items",), ("meta",) if kind == "odict" else ()
        )
        out: dict[Any, Any] = {} if kind == "dict" else OrderedDict()
        if has_v:
            v = n["v"]
            if type(v) is not dict:
                self.fail(path, f"{kind!r} field 'v' must be an object, got {type(v).__name__}")
            self.enter(path, depth, 2 * len(v))
            for k, e in v.items():
                self.string(k, path, "dict key")
                out[k] = self.node(e, (*path, k), depth + 1, False)
        else:
            items = n["items"]
            if type(items) is not list:
                self.fail(
                    path, f"{kind!r} field 'items' must be a list, got {type(items).__name__}"
                )
            self.enter(path, depth, 2 * len(items))
            for i, pair in enumerate(items):
                if type(pair) is not list or len(pair) != 2:
                    self.fail(path, f"{kind!r} item {i} must be a [key, value] list")
                k = self.node(pair[0], (*path, f"<key {i}>"), depth + 1, True)
                try:
                    dup = k in out
                except TypeError:
                    self.fail(path, f"dict key {i} ({_brief(k)}) is not hashable")
                if dup:
                    self.fail(path, f"duplicate dict key {_brief(k)}")
                out[k] = self.node(pair[1], (*path, str(k)), depth + 1, False)
        if "meta" in n:
            self.enter(path, depth, 1)
            out._metadata = self.node(n["meta"], (*path, "_metadata"), depth + 1, False)  # type: ignore[attr-defined]
        return out

    def leaf(
        self, n: dict[str, Any], path: Path, key: bool, kind: str, fields: tuple[str, ...]
    ) -> None:
        if key and kind in ("tensor", "ndarray"):
            self.fail(path, f"a {kind!r} cannot be a dict key")
        self.fields(n, path, kind, fields)

    def tensor(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "tensor", ("i",))
        i = self.integer(n["i"], path, "tensor index", 0, self.count - 1)
        self.used.add(i)
        return None if self.tensors is None else self.tensors[i]

    def float_(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "float", ("bits",))
        bits = self.string(n["bits"], path, "'float' field 'bits'")
        if not _HEX16.fullmatch(bits):
            self.fail(
                path, f"'float' field 'bits' must be 16 lowercase hex digits, got {_brief(bits)}"
            )
        return struct.unpack(">d", bytes.fromhex(bits))[0]

    def b64(self, n: dict[str, Any], path: Path, kind: str) -> bytes:
        text = self.string(n["b64"], path, f"{kind!r} field 'b64'")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            self.fail(path, f"{kind!r} field 'b64' is not valid base64")

    def bytes_(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "bytes", ("b64",))
        return self.b64(n, path, "bytes")

    def np_dtype(self, n: dict[str, Any], path: Path, kind: str) -> np.dtype[Any]:
        s = self.string(n["dtype"], path, f"{kind!r} field 'dtype'")
        if not NP_DTYPE_PATTERN.fullmatch(s):
            self.fail(path, f"{kind!r} dtype {_brief(s)} is not a supported NumPy dtype string")
        try:
            dt = np.dtype(s)
        except (TypeError, ValueError):
            self.fail(path, f"{kind!r} dtype {s!r} is not a NumPy dtype")
        # Only a scalar may be an empty string ('', b''); arrays never have itemsize 0.
        if dt.kind in "OV" or (dt.itemsize == 0 and kind != "npscalar"):
            self.fail(path, f"{kind!r} dtype {s!r} is not supported (object, record or empty)")
        return dt

    def ndarray(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "ndarray", ("dtype", "shape", "b64"))
        dt = self.np_dtype(n, path, "ndarray")
        shape = n["shape"]
        if type(shape) is not list or len(shape) > 32:
            self.fail(path, "'ndarray' field 'shape' must be a list of at most 32 ints")
        numel = 1
        for d in shape:
            numel *= self.integer(d, path, "'ndarray' dimension", 0, _INT64_MAX)
        raw = self.b64(n, path, "ndarray")
        if len(raw) != numel * dt.itemsize:
            self.fail(
                path,
                f"'ndarray' holds {len(raw)} bytes but shape {shape} of {dt.str} "
                f"needs {numel * dt.itemsize}",
            )
        try:
            return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
        except ValueError as exc:
            self.fail(path, f"'ndarray' shape {shape} is not supported: {exc}")

    def npscalar(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "npscalar", ("dtype", "hex"))
        dt = self.np_dtype(n, path, "npscalar")
        text = self.string(n["hex"], path, "'npscalar' field 'hex'")
        if not _HEX.fullmatch(text) or len(text) != 2 * dt.itemsize:
            self.fail(
                path, f"'npscalar' field 'hex' must be {2 * dt.itemsize} lowercase hex digits"
            )
        if dt.itemsize == 0:
            return dt.type()
        return np.frombuffer(bytes.fromhex(text), dtype=dt)[0]

    def dtype(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "dtype", ("v",))
        name = self.string(n["v"], path, "'dtype' field 'v'")
        if name not in TORCH_DTYPES:
            self.fail(path, f"unknown torch dtype {_brief(name)}")
        return TORCH_DTYPES[name]

    def device(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "device", ("v",))
        name = self.string(n["v"], path, "'device' field 'v'")
        if not DEVICE_PATTERN.fullmatch(name):
            self.fail(path, f"malformed torch device {_brief(name)}")
        try:
            return torch.device(name)
        except (RuntimeError, ValueError):
            self.fail(path, f"unknown torch device {name!r}")

    def size(self, n: dict[str, Any], path: Path, depth: int, key: bool) -> Any:
        self.leaf(n, path, key, "size", ("v",))
        v = n["v"]
        if type(v) is not list or len(v) > 64:
            self.fail(path, "'size' field 'v' must be a list of at most 64 ints")
        return torch.Size(
            [self.integer(d, path, "'size' dimension", _INT64_MIN, _INT64_MAX) for d in v]
        )


_KINDS: dict[str, Callable[[_Reader, dict[str, Any], Path, int, bool], Any]] = {
    "tuple": _Reader.tuple_,
    "dict": _Reader.dict_,
    "odict": _Reader.dict_,
    "tensor": _Reader.tensor,
    "float": _Reader.float_,
    "bytes": _Reader.bytes_,
    "ndarray": _Reader.ndarray,
    "npscalar": _Reader.npscalar,
    "dtype": _Reader.dtype,
    "device": _Reader.device,
    "size": _Reader.size,
}

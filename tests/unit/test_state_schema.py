"""The state document schema: property tests for round trips and for the
validator (accepts what we encode, rejects mutations with StateSchemaError and
nothing else), plus hand-written malformed documents and limits."""

from __future__ import annotations

import copy
import json
import math
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lm_resiliency.errors import StateEncodingError, StateSchemaError
from lm_resiliency.state import (
    SCHEMA_VERSION,
    DocumentLimits,
    decode_state,
    encode_state,
    validate_document,
)

torch.set_num_threads(1)

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality; tensors must be the very objects passed to decode."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a is b, path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path}/<key {ka!r}>")
            assert_same(va, vb, f"{path}/{ka!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# --- strategies -----------------------------------------------------------------------

_NAN_PAYLOAD = struct.unpack(">d", bytes.fromhex("fff8000000abcdef"))[0]
floats = st.floats() | st.sampled_from([-0.0, math.inf, -math.inf, math.nan, _NAN_PAYLOAD])
ints = st.integers(min_value=-(2**130), max_value=2**130)
np_dtypes = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(endianness="?")
    | hnp.complex_number_dtypes(endianness="?")
    | hnp.datetime64_dtypes(endianness="?")
    | hnp.timedelta64_dtypes(endianness="?")
    | hnp.byte_string_dtypes(min_len=1, max_len=4)
    | hnp.unicode_string_dtypes(min_len=1, max_len=4)
)
np_arrays = hnp.arrays(np_dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
np_scalars = hnp.arrays(np_dtypes, ()).map(lambda a: a[()])
_TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
tensors = st.builds(
    lambda dt, shape: torch.zeros(shape).to(dt),
    st.sampled_from(_TORCH_DTYPES),
    st.lists(st.integers(0, 3), max_size=3),
)
torch_values = st.sampled_from(
    [torch.float32, torch.bfloat16, torch.int64, torch.device("cpu"), torch.device("cuda:3")]
) | st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size)
plain = st.none() | st.booleans() | ints | floats | st.text(max_size=40) | st.binary(max_size=16)
keys = st.recursive(
    plain | np_scalars | st.sampled_from([torch.float16, torch.device("cpu")]),
    lambda c: st.lists(c, max_size=3).map(tuple),
    max_leaves=4,
)
leaves = plain | np_scalars | np_arrays | tensors | torch_values
trees = st.recursive(
    leaves,
    lambda c: (
        st.lists(c, max_size=4)
        | st.lists(c, max_size=4).map(tuple)
        | st.dictionaries(keys, c, max_size=4)
        | st.dictionaries(keys, c, max_size=4).map(OrderedDict)
        | st.dictionaries(st.text(max_size=10), c, max_size=4)
    ),
    max_leaves=25,
)


def _json(doc: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(doc, allow_nan=False))


def _encoded(tree: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    enc = encode_state(tree)
    return _json(enc.document), enc.tensors


# --- round trip -----------------------------------------------------------------------


@PROPERTY
@given(trees)
def test_random_trees_round_trip_exactly(tree: Any) -> None:
    doc, tensors = _encoded(tree)
    validate_document(doc, tensor_count=len(tensors))
    assert_same(tree, decode_state(doc, tensors))


# --- mutations ------------------------------------------------------------------------


def _locations(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) slot of a JSON document, parents before children."""
    if isinstance(node, dict):
        for k in list(node):
            out.append((node, k))
            _locations(node[k], out)
    elif isinstance(node, list):
        for i in range(len(node)):
            out.append((node, i))
            _locations(node[i], out)
    return out


def _tagged(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c[k] for c, k in _locations(doc, []) if isinstance(c[k], dict) and "k" in c[k]]


_WRONG_TYPE = {list: {"x": 1}, dict: [1], str: 12345, int: "0"}


def _always_invalid_mutation(doc: dict[str, Any], data: st.DataObject) -> str:
    """Apply one mutation the schema must reject; return its description."""
    tagged = [n for n in _tagged(doc) if isinstance(n["k"], str)]
    choices = [
        "unknown kind",
        "missing field",
        "extra field",
        "wrong field type",
        "non-JSON value",
        "top-level",
    ]
    if not tagged:
        choices = ["non-JSON value", "top-level"]
    what = data.draw(st.sampled_from(choices))
    if what == "top-level":
        field = data.draw(st.sampled_from(["schema", "tensor_count", "root", "wrong schema"]))
        if field == "wrong schema":
            doc["schema"] = "lm_resiliency.state/0"
        else:
            del doc[field]
        return f"{what} {field}"
    if what == "non-JSON value":
        container, key = data.draw(st.sampled_from(_locations(doc, [])))
        container[key] = data.draw(st.sampled_from([{1, 2}, (1,), b"x", object(), 1j]))
        return what
    node = data.draw(st.sampled_from(tagged))
    fields = [f for f in node if f not in ("k", "meta")]
    if what == "unknown kind":
        node["k"] = data.draw(st.sampled_from(["bogus", "", "Tensor", "pickle"]))
    elif what == "missing field":
        del node[data.draw(st.sampled_from(fields))]
    elif what == "extra field":
        node[data.draw(st.sampled_from(["extra", "K", "i2"]))] = 0
    else:
        field = data.draw(st.sampled_from(fields))
        node[field] = _WRONG_TYPE[type(node[field])]
    return f"{what} on a {node.get('k')!r} node"


@PROPERTY
@given(trees, st.data())
def test_validator_rejects_always_invalid_mutations_with_schema_error(
    tree: Any, data: st.DataObject
) -> None:
    doc, tensors = _encoded({"state": tree})
    what = _always_invalid_mutation(doc, data)
    with pytest.raises(StateSchemaError):
        validate_document(doc)
    with pytest.raises(StateSchemaError):
        decode_state(doc, tensors)
    assert what


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(st.sampled_from(["k", "v", "i", "x"]), c, max_size=3)
    ),
    max_leaves=6,
) | st.sampled_from([{"k": "tensor", "i": 10**6}, {"k": "tuple", "v": "x"}, math.nan])


@PROPERTY
@given(trees, st.data())
def test_validator_never_raises_anything_but_schema_error(tree: Any, data: st.DataObject) -> None:
    doc, tensors = _encoded({"state": tree})
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = data.draw(st.sampled_from(_locations(doc, [])))
        container[key] = copy.deepcopy(data.draw(json_values))  # never alias the strategy's own
    try:
        validate_document(doc)
    except StateSchemaError:
        return
    # Valid after all: it must decode without any other error.
    decode_state(doc, tensors)


@PROPERTY
@given(trees)
def test_validation_does_not_modify_the_document(tree: Any) -> None:
    doc, tensors = _encoded(tree)
    before = copy.deepcopy(doc)
    decode_state(doc, tensors)
    assert doc == before


# --- hand-written malformed documents ----------------------------------------------------


def _doc(root: Any, tensor_count: int = 0) -> dict[str, Any]:
    return {"schema": SCHEMA_VERSION, "tensor_count": tensor_count, "root": root}


def _deep(depth: int) -> Any:
    node: Any = 0
    for _ in range(depth):
        node = [node]
    return node


def _cyclic() -> Any:
    loop: list[Any] = []
    loop.append(loop)
    return loop


T = {"k": "tensor", "i": 0}
MALFORMED = [
    ([], "must be a JSON object"),
    ({"schema": SCHEMA_VERSION, "root": 1}, "missing field(s) ['tensor_count']"),
    ({**_doc(1), "extra": 1}, "unexpected field(s) ['extra']"),
    ({**_doc(1), "schema": "lm_resiliency.state/2"}, "unsupported state schema"),
    (_doc(1, tensor_count=-1), "tensor_count must be an int"),
    (_doc(1, tensor_count=True), "tensor_count must be an int"),
    (_doc({"k": "tensor", "i": 1}, 1), "tensor index=1 is outside [0, 0]"),
    (_doc({"k": "tensor", "i": -1}, 1), "outside [0, 0]"),
    (_doc({"k": "tensor", "i": False}, 1), "tensor index must be an int, got bool"),
    (_doc({"k": "tensor", "i": 0}, 2), "tensor 1 of 2 is never referenced"),
    (_doc({"k": "dict", "v": {"a": {"k": "nope"}}}), "at 'a': unknown node kind 'nope'"),
    (_doc({"k": 3}), "unknown node kind 3"),
    (_doc({"v": 1}), "unknown node kind None"),
    (_doc({"k": "tuple"}), "missing field(s) ['v']"),
    (_doc({"k": "tuple", "v": []}), None),
    (_doc({"k": "tuple", "v": {}}), "'tuple' field 'v' must be a list"),
    (_doc({"k": "dict", "v": {}, "items": []}), "exactly one of fields 'v' and 'items'"),
    (_doc({"k": "dict", "v": {}, "meta": {}}), "unexpected field(s) ['meta']"),
    (_doc({"k": "dict", "items": [[1, 2, 3]]}), "item 0 must be a [key, value] list"),
    (_doc({"k": "dict", "items": [[1, 2], [1, 3]]}), "duplicate dict key 1"),
    (_doc({"k": "dict", "items": [[True, 2], [1, 3]]}), "duplicate dict key 1"),
    (_doc({"k": "dict", "items": [[[1], 2]]}), "a list cannot be a dict key"),
    (_doc({"k": "dict", "items": [[T, 2]]}, 1), "a 'tensor' cannot be a dict key"),
    (_doc({"k": "dict", "items": [[{"k": "dict", "v": {}}, 2]]}), "cannot be a dict key"),
    (_doc({"k": "dict", "items": [[{"k": "tuple", "v": [[1]]}, 2]]}), "list cannot be a dict key"),
    (_doc(math.nan), "bare float must be finite"),
    (_doc(math.inf), "bare float must be finite"),
    (_doc({"k": "float", "bits": "7ff8"}), "16 lowercase hex digits"),
    (_doc({"k": "float", "bits": "7FF8000000000000"}), "16 lowercase hex digits"),
    (_doc((1, 2)), "value of type tuple is not JSON"),
    (_doc({"k": "dict", "v": {1: 2}}), "dict key must be a string, got int"),
    (_doc("bad \ud800"), "lone surrogate"),
    (_doc({"k": "bytes", "b64": "not base64!"}), "not valid base64"),
    (
        _doc({"k": "ndarray", "dtype": "|O8", "shape": [1], "b64": "AAAAAAAAAAA="}),
        "not a supported NumPy dtype",
    ),
    (
        _doc({"k": "ndarray", "dtype": "|V8", "shape": [1], "b64": "AAAAAAAAAAA="}),
        "not a supported NumPy dtype",
    ),
    (
        _doc({"k": "ndarray", "dtype": "<f8", "shape": [2], "b64": "AAAAAAAAAAA="}),
        "holds 8 bytes but shape [2] of <f8 needs 16",
    ),
    (_doc({"k": "ndarray", "dtype": "<f8", "shape": [-1], "b64": ""}), "outside [0,"),
    (
        _doc({"k": "ndarray", "dtype": "<f8", "shape": [0, 2**62, 2**62], "b64": ""}),
        "is not supported",
    ),
    (_doc({"k": "ndarray", "dtype": "<S0", "shape": [1], "b64": ""}), "not supported"),
    (_doc({"k": "npscalar", "dtype": "<i4", "hex": "0000"}), "must be 8 lowercase hex digits"),
    (_doc({"k": "dtype", "v": "float128"}), "unknown torch dtype 'float128'"),
    (_doc({"k": "device", "v": "cuda:0; rm -rf"}), "malformed torch device"),
    (_doc({"k": "device", "v": "warp:0"}), "unknown torch device 'warp:0'"),
    (_doc({"k": "size", "v": [1, "2"]}), "'size' dimension must be an int"),
    (_doc({"k": "size", "v": [2**64]}), "outside"),
    (_doc(2**5000), "over DocumentLimits.max_int_bits=4096"),
    (_doc(_deep(10_000)), "deeper than DocumentLimits.max_depth=64"),
    (_doc(_cyclic()), "deeper than DocumentLimits.max_depth=64"),
]


@pytest.mark.parametrize(("document", "fragment"), MALFORMED)
def test_malformed_documents_are_rejected_with_a_message_naming_the_problem(
    document: Any, fragment: str | None
) -> None:
    if fragment is None:  # control: a valid document
        validate_document(document)
        return
    with pytest.raises(StateSchemaError) as info:
        validate_document(document)
    assert fragment in str(info.value)


def test_error_names_the_key_path_of_the_bad_node() -> None:
    doc = _json(encode_state({"optimizer": {"state": {3: {"exp_avg": torch.ones(1)}}}}).document)
    doc["root"]["v"]["optimizer"]["v"]["state"]["items"][0][1]["v"]["exp_avg"]["i"] = 7
    with pytest.raises(StateSchemaError, match=r"at 'optimizer/state/3/exp_avg': tensor index=7"):
        validate_document(doc)


# --- limits --------------------------------------------------------------------------------


def test_validator_limits_name_the_limit() -> None:
    limits = DocumentLimits(
        max_depth=3, max_items=10, max_string_bytes=8, max_bytes=120, max_int_bits=16
    )
    validate_document(_doc(_deep(3)), limits=limits)
    with pytest.raises(StateSchemaError, match=r"deeper than DocumentLimits\.max_depth=3"):
        validate_document(_doc(_deep(4)), limits=limits)
    with pytest.raises(StateSchemaError, match=r"deeper than DocumentLimits\.max_depth=3"):
        validate_document(
            _doc({"k": "tuple", "v": [{"k": "dict", "v": {"a": [[1]]}}]}), limits=limits
        )
    validate_document(_doc(list(range(9))), limits=limits)
    with pytest.raises(StateSchemaError, match=r"more than DocumentLimits\.max_items=10 values"):
        validate_document(_doc(list(range(10))), limits=limits)
    with pytest.raises(StateSchemaError, match=r"more than DocumentLimits\.max_items=10 values"):
        validate_document(_doc({"k": "dict", "v": {str(i): i for i in range(5)}}), limits=limits)
    with pytest.raises(StateSchemaError, match=r"over DocumentLimits\.max_string_bytes=8"):
        validate_document(_doc("ééééé"), limits=limits)
    with pytest.raises(StateSchemaError, match=r"over DocumentLimits\.max_int_bits=16"):
        validate_document(_doc([2**16]), limits=limits)
    with pytest.raises(StateSchemaError, match=r"over DocumentLimits\.max_bytes=120"):
        validate_document(_doc(["abcdefgh"] * 9), limits=limits)


@PROPERTY
@given(trees)
def test_what_encode_accepts_under_tight_limits_validates_under_them(tree: Any) -> None:
    limits = DocumentLimits(
        max_depth=3, max_items=40, max_string_bytes=64, max_bytes=3000, max_int_bits=100
    )
    try:
        enc = encode_state(tree, limits=limits)
    except StateEncodingError as exc:
        assert "DocumentLimits." in str(exc)
        return
    validate_document(_json(enc.document), tensor_count=len(enc.tensors), limits=limits)

"""State trees -> (tensors, JSON document) -> state trees, bit for bit, and the
errors raised at capture time for values that cannot be encoded safely."""

from __future__ import annotations

import collections
import json
import math
import random
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lm_resiliency.capture import Layout, allocate_arena
from lm_resiliency.errors import ConfigError, StateEncodingError, StateSchemaError
from lm_resiliency.state import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    Deferred,
    DocumentLimits,
    begin_encoding,
    decode_state,
    dumps_document,
    encode_state,
    loads_document,
    validate_document,
)

torch.set_num_threads(1)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality: same types, same order, bit-equal numbers."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path}/<key {ka!r}>")
            assert_same(va, vb, f"{path}/{ka}")
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), path)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(tree: Any, **kw: Any) -> tuple[Any, Any]:
    """Encode, pass the document through JSON text, decode with the same tensors."""
    enc = encode_state(tree, **kw)
    doc = json.loads(json.dumps(enc.document, allow_nan=False))
    return enc, decode_state(doc, enc.tensors, **kw)


# --- a representative training state -------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(att @ v)
        return x + self.out(torch.relu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 8, n_blocks: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[-1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _lambda_factor(epoch: int) -> float:
    return 0.5**epoch


def _training(seed: int = 0) -> tuple[TinyGPT, torch.optim.AdamW, Any, Any]:
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, _lambda_factor)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, lam, step_lr


def _step(model: TinyGPT, opt: torch.optim.Optimizer, *scheds: Any) -> None:
    idx = torch.arange(12).remainder(32).reshape(2, 6)
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    for s in scheds:
        s.step()


def _representative_state() -> tuple[dict[str, Any], tuple[Any, ...]]:
    model, opt, lam, step_lr = _training()
    for _ in range(2):
        _step(model, opt, lam, step_lr)
    random.seed(3)
    np.random.seed(4)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "schedulers": [lam.state_dict(), step_lr.state_dict()],
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "numpy_generator": np.random.default_rng(1).bit_generator.state,
            "python": random.getstate(),
        },
        "data": {
            "epoch": 1,
            "batch_index": 2,
            "consumed_samples": 24,
            "shuffle_seed": 7,
            "loss_scale": 65536.0,
            "order": (3, 1, 2),
        },
    }
    return state, (model, opt, lam, step_lr)


def test_representative_state_round_trips_bit_exactly_through_an_arena() -> None:
    state, _ = _representative_state()
    enc = encode_state(state)
    # Tied lm_head/wte is captured once; everything else once each.
    sd = state["model"]
    n_opt = sum(len(s) for s in state["optimizer"]["state"].values())
    assert len(enc.tensors) == (len(sd) - 1) + n_opt + 1
    assert len(set(enc.names)) == len(enc.names)
    assert enc.names[0] == "model/wte.weight"
    assert "optimizer/state/0/exp_avg" in enc.names
    assert "rng/torch" in enc.names
    assert "model/lm_head.weight" not in enc.names
    assert enc.tensors[0] is sd["wte.weight"]  # referenced, not copied

    # What the capture engine does: copy into one arena, decode from its views.
    layout = Layout.from_tensors(enc.tensors, enc.names)
    arena = allocate_arena(layout.total_bytes, pin=False)
    views = layout.views(arena)
    for v, t in zip(views, enc.tensors, strict=True):
        v.copy_(t)
    text = dumps_document(enc.document)
    out = decode_state(loads_document(text), views)

    assert_same(state, out)
    assert out["model"]["wte.weight"] is out["model"]["lm_head.weight"]
    assert out["model"]["wte.weight"].data_ptr() == views[0].data_ptr()
    assert isinstance(out["model"], OrderedDict)
    assert out["model"]._metadata == sd._metadata
    assert list(out["model"]) == list(sd)
    assert all(type(k) is int for k in out["optimizer"]["state"])
    assert type(out["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert type(out["optimizer"]["param_groups"][0]["lr"]) is float
    assert type(out["rng"]["numpy"]) is tuple and out["rng"]["numpy"][1].dtype == np.uint32
    assert type(out["data"]["order"]) is tuple


def test_decoded_state_loads_into_fresh_objects_and_training_continues_identically() -> None:
    state, (model, opt, lam, step_lr) = _representative_state()
    enc = encode_state(state)
    copies = [t.clone() for t in enc.tensors]
    out = decode_state(json.loads(json.dumps(enc.document)), copies)

    model2, opt2, lam2, step2 = _training(seed=99)  # different initial weights
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optimizer"])
    lam2.load_state_dict(out["schedulers"][0])
    step2.load_state_dict(out["schedulers"][1])
    assert model2.lm_head.weight is model2.wte.weight
    assert lam2.get_last_lr() == lam.get_last_lr()
    assert step2.get_last_lr() == step_lr.get_last_lr()

    _step(model, opt, lam, step_lr)
    _step(model2, opt2, lam2, step2)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert n1 == n2
        assert torch.equal(p1, p2), n1
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(
        opt2.state_dict()["state"][3]["exp_avg"], opt.state_dict()["state"][3]["exp_avg"]
    )


def test_restored_rng_states_reproduce_the_same_random_numbers() -> None:
    state, _ = _representative_state()
    enc = encode_state(state["rng"])
    rng = decode_state(json.loads(json.dumps(enc.document)), [t.clone() for t in enc.tensors])

    def draw() -> tuple[torch.Tensor, np.ndarray, np.ndarray, list[float]]:
        g = np.random.default_rng()
        g.bit_generator.state = rng["numpy_generator"]
        return torch.rand(5), np.random.rand(5), g.random(5), [random.random() for _ in range(5)]

    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    first = draw()
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    g0 = np.random.default_rng()
    g0.bit_generator.state = state["rng"]["numpy_generator"]
    expected = (torch.rand(5), np.random.rand(5), g0.random(5), [random.random() for _ in range(5)])
    assert torch.equal(first[0], expected[0])
    assert np.array_equal(first[1], expected[1])
    assert np.array_equal(first[2], expected[2])
    assert first[3] == expected[3]


# --- values and types ----------------------------------------------------------------


def test_plain_values_keep_their_types_and_bits() -> None:
    nan_payload = struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0]
    tree = {
        "floats": [0.0, -0.0, 1.0, 1e308, 5e-324, math.inf, -math.inf, math.nan, nan_payload],
        "ints": [0, -1, 2**63, -(2**100), True, False],
        "none": None,
        "text": ["", "ascii", "ünïcødé ✓ 🚀", "x" * 100, '"quoted" \\ \n\t\x00'],
        "bytes": b"\x00\xffbinary",
        "tuple": (1, (2.0, [3, (4,)]), ()),
        "list": [],
        "torch": [
            torch.float32,
            torch.bfloat16,
            torch.device("cpu"),
            torch.device("cuda:1"),
            torch.Size([2, 3]),
            torch.Size([]),
        ],
        "numpy": [
            np.float32(1.5),
            np.float64(-0.0),
            np.int64(-3),
            np.uint8(200),
            np.bool_(True),
            np.float16(np.nan),
            np.complex64(1 + 2j),
            np.str_("hé"),
            np.bytes_(b"ab"),
            np.datetime64("2024-01-02T03:04", "m"),
            np.timedelta64(5, "s"),
        ],
        "arrays": [
            np.arange(6, dtype=">i4").reshape(2, 3),
            np.zeros((0, 3)),
            np.array(2.5),
            np.asfortranarray(np.arange(6.0).reshape(2, 3)),
            np.array(["a", "bcd"]),
            np.array([True, False]),
            np.array([1 + 1j], dtype=np.complex128),
        ],
    }
    enc, out = roundtrip(tree)
    assert enc.tensors == []
    assert_same(tree, out)
    assert out["arrays"][0].flags.writeable


def test_dict_keys_of_any_plain_hashable_type_and_order_survive() -> None:
    tree = {
        0: "int",
        -5: "neg",
        2**70: "big",
        1.5: "float",
        math.inf: "inf",
        None: "none",
        True: "bool",
        "s": "str",
        b"b": "bytes",
        (1, "a", (2.0,)): "tuple",
        torch.float16: "dtype",
        np.int32(7): "npint",
    }
    odict = OrderedDict([("z", 1), ("a", 2), (3, 3)])
    enc, out = roundtrip({"keys": tree, "odict": odict, "str_keys": {"b": 1, "a": 2}})
    assert_same(tree, out["keys"])
    assert isinstance(out["odict"], OrderedDict) and list(out["odict"].items()) == list(
        odict.items()
    )
    assert list(out["str_keys"]) == ["b", "a"]
    assert enc.document["root"]["v"]["str_keys"] == {"k": "dict", "v": {"b": 1, "a": 2}}


def test_same_tensor_and_exact_aliases_are_stored_once_other_views_are_not() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    empty_a, empty_b = torch.empty(0), torch.empty(0)
    tree = {
        "a": base,
        "same": base,
        "detached": base.detach(),  # same storage, pointer, shape, stride: an alias
        "row": base[1],  # a different view of the same storage: its own tensor
        "transposed": base.t(),
        "empty": [empty_a, empty_b],
    }
    enc = encode_state(tree)
    assert enc.names == ["a", "row", "transposed", "empty/0", "empty/1"]
    assert enc.tensors[0] is base and enc.tensors[3] is empty_a and enc.tensors[4] is empty_b
    out = decode_state(enc.document, [t.clone() for t in enc.tensors])
    assert out["a"] is out["same"] is out["detached"]
    assert out["row"] is not out["a"] and torch.equal(out["row"], base[1])
    assert out["empty"][0] is not out["empty"][1]


def test_names_are_unique_key_paths() -> None:
    t1, t2, t3, t4 = (torch.ones(1) * i for i in range(4))
    enc = encode_state({"a/b": t1, "a": {"b": t2}, 0: t3, "0": t4})
    assert enc.names == ["a/b", "a/b#2", "0", "0#2"]
    root = encode_state(t1)
    assert root.names == ["<root>"]
    assert decode_state(root.document, [t2]) is t2


def test_parameters_encode_as_tensors() -> None:
    p = nn.Parameter(torch.randn(3))
    enc, out = roundtrip({"p": p})
    assert enc.tensors[0] is p and out["p"] is p
    assert enc.names == ["p"]


def test_encoded_document_is_plain_json_and_validates() -> None:
    state, _ = _representative_state()
    enc = encode_state(state)
    text = json.dumps(enc.document, allow_nan=False)
    assert enc.document["schema"] == SCHEMA_VERSION == "lm_resiliency.state/1"
    assert enc.document["tensor_count"] == len(enc.tensors)
    validate_document(json.loads(text), tensor_count=len(enc.tensors))
    assert json.loads(dumps_document(enc.document)) == json.loads(text)


# --- unsupported values fail at encode time ---------------------------------------------


class _Opaque:
    pass


class _SubTensor(torch.Tensor):
    pass


Point = collections.namedtuple("Point", "x y")


def _identity(x: Any) -> Any:
    return x


# Factories, so the deprecated/beta constructors run inside the (warning-filtered) test.
@pytest.mark.parametrize(
    ("make", "type_name", "fix"),
    [
        (_Opaque, "_Opaque", "extra_state"),
        (lambda: _identity, "function", "callables cannot be captured"),
        (lambda: lambda x: x, "function", "callables cannot be captured"),
        (lambda: {1, 2}, "set", "sorted list"),
        (lambda: frozenset({1}), "frozenset", "sorted list"),
        (lambda: np.array([1, "a"], dtype=object), "numpy.ndarray with dtype '|O'", "list"),
        (lambda: np.zeros(2, dtype=[("a", "<i4")]), "numpy.ndarray", "dtype"),
        (lambda: torch.eye(2).to_sparse(), "sparse_coo torch.Tensor", "to_dense"),
        (lambda: torch.eye(2).to_sparse_csr(), "sparse_csr torch.Tensor", "to_dense"),
        (
            lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
            "quantized torch.Tensor",
            "dequantize",
        ),
        (lambda: torch.empty(2, device="meta"), "meta torch.Tensor", "materialize"),
        (lambda: torch.Tensor._make_subclass(_SubTensor, torch.ones(2)), "_SubTensor", "to_local"),
        (lambda: Point(1, 2), "Point", "_asdict"),
        (lambda: collections.defaultdict(list), "defaultdict", "dict(...)"),
        (lambda: bytearray(b"x"), "bytearray", "bytes(...)"),
        (lambda: np.ma.array([1, 2]), "MaskedArray", "np.asarray"),
        (lambda: range(3), "range", "supported type"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_value_names_key_path_type_and_fix(make: Any, type_name: str, fix: str) -> None:
    tree = {"optimizer": {"state": {3: {"exp_avg": make()}}}}
    with pytest.raises(StateEncodingError) as info:
        encode_state(tree)
    msg = str(info.value)
    assert "'optimizer/state/3/exp_avg'" in msg
    assert type_name in msg
    assert fix in msg


@pytest.mark.parametrize(
    ("tree", "where", "fragment"),
    [
        ({"d": {torch.ones(1): 1}}, "d/", "dict key of type Tensor is not supported"),
        ({"d": {(1, _Opaque()): 1}}, "d/", "dict key of type _Opaque is not supported"),
        ({"s": ["ok", "bad \udc80"]}, "s/1", "lone surrogate"),
        ({"s": {"k\udc80": 1}}, "s/k", "lone surrogate"),
    ],
)
def test_unsupported_keys_and_strings(tree: Any, where: str, fragment: str) -> None:
    with pytest.raises(StateEncodingError, match=fragment) as info:
        encode_state(tree)
    assert where in str(info.value)


def test_state_encoding_error_is_also_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode_state({"x": object()})


# --- limits ------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    tree: Any = 1
    for _ in range(depth):
        tree = [tree]
    return tree


def test_encode_enforces_depth_items_string_int_and_size_limits() -> None:
    limits = DocumentLimits(
        max_depth=4, max_items=50, max_string_bytes=64, max_int_bits=64, max_bytes=2000
    )
    encode_state(_nested(4), limits=limits)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_depth=4") as info:
        encode_state({"a": {"b": _nested(3)}}, limits=limits)
    assert "'a/b/0/0'" in str(info.value)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_items=50"):
        encode_state(list(range(50)), limits=limits)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_string_bytes=64"):
        encode_state({"s": "é" * 33}, limits=limits)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_string_bytes=64"):
        encode_state({"a": np.zeros(10)}, limits=limits)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_int_bits=64"):
        encode_state({"i": [1, 2**64]}, limits=limits)
    with pytest.raises(StateEncodingError, match=r"DocumentLimits\.max_bytes=2000"):
        encode_state(["x" * 60] * 40, limits=limits)


def test_reference_cycle_is_reported_as_too_deep() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(StateEncodingError, match="reference cycle"):
        encode_state({"loop": loop})


def test_limits_reject_bad_configuration() -> None:
    with pytest.raises(ConfigError, match="max_items=0"):
        DocumentLimits(max_items=0)
    with pytest.raises(ConfigError, match="max_depth=1000"):
        DocumentLimits(max_depth=1000)
    with pytest.raises(ConfigError, match="max_int_bits=100000"):
        DocumentLimits(max_int_bits=100_000)
    assert DEFAULT_LIMITS.max_depth == 64


def test_encoded_document_passes_validation_at_the_same_limits() -> None:
    limits = DocumentLimits(max_depth=5, max_items=200, max_string_bytes=200, max_bytes=4000)
    tree = {"a": [[[{"b": "y" * 199}]]], "n": list(range(100)), "t": torch.ones(2)}
    enc = encode_state(tree, limits=limits)
    validate_document(json.loads(json.dumps(enc.document)), limits=limits, tensor_count=1)


# --- decode-side checks ------------------------------------------------------------------


def test_decode_checks_tensor_count_and_types() -> None:
    enc = encode_state({"a": torch.ones(1), "b": torch.zeros(1)})
    with pytest.raises(StateSchemaError, match="references 2 tensors but 1 were given"):
        decode_state(enc.document, enc.tensors[:1])
    with pytest.raises(StateSchemaError, match=r"tensors\[1\] is a ndarray"):
        decode_state(enc.document, [torch.ones(1), np.zeros(1)])  # type: ignore[list-item]
    with pytest.raises(StateSchemaError, match="references 2 tensors but 3 were given"):
        validate_document(enc.document, tensor_count=3)


def test_loads_document_rejects_non_json_text() -> None:
    with pytest.raises(StateSchemaError, match="not valid JSON"):
        loads_document('{"a": NaN}')
    with pytest.raises(StateSchemaError, match="not valid JSON"):
        loads_document(b"\xff\xfe")
    with pytest.raises(StateSchemaError, match="must be a JSON object"):
        loads_document("[1]")
    with pytest.raises(StateSchemaError, match=r"DocumentLimits\.max_bytes=10"):
        loads_document('{"schema": "x"}', limits=DocumentLimits(max_bytes=10))
    with pytest.raises(StateSchemaError, match="not valid JSON"):
        loads_document("[" * 100_000 + "]" * 100_000)


def test_deferred_subtree_walked_later_decodes_to_the_same_tree() -> None:
    model = nn.Linear(4, 3)
    shared = model.weight.detach()
    tree = {
        "adapter": {"model": model.state_dict(), "tied": shared, "step": 3},
        "rank": {"rng": torch.get_rng_state(), "alias": model.weight.detach()},
    }
    partial = begin_encoding({"adapter": Deferred(tree["adapter"]), "rank": tree["rank"]})
    # the part walked now comes first; the alias in the deferred part resolves to it
    enc = partial.finish()
    assert enc.names[:2] == ["rank/rng", "rank/alias"]
    assert len(enc.tensors) == 3  # rng, weight (three references), bias
    validate_document(json.loads(json.dumps(enc.document)))
    out = decode_state(enc.document, enc.tensors)
    assert_same(out, tree)
    assert out["adapter"]["tied"] is out["rank"]["alias"]
    # encode_state walks a Deferred at once: same tree
    assert_same(
        decode_state(*_parts(encode_state({"adapter": Deferred(tree["adapter"])}))),
        {"adapter": tree["adapter"]},
    )


def _parts(enc: Any) -> tuple[Any, Any]:
    return enc.document, enc.tensors


def test_deferred_subtree_error_names_its_key_path_when_finished() -> None:
    partial = begin_encoding({"adapter": Deferred({"hooks": {"fn": print}}), "ok": 1})
    with pytest.raises(StateEncodingError, match="adapter/hooks/fn"):
        partial.finish()


def test_a_deferred_function_is_called_where_the_walk_happens() -> None:
    calls: list[str] = []
    model = nn.Linear(4, 3)

    def build() -> dict[str, Any]:
        calls.append("built")
        return {"model": model.state_dict(), "n": len(calls)}

    partial = begin_encoding({"adapter": Deferred(build), "step": 1})
    assert calls == []  # not at the boundary
    with torch.no_grad():
        model.weight.add_(1)  # what the function reads is read when the walk happens
    out = decode_state(*_parts(partial.finish()))
    assert calls == ["built"]
    assert torch.equal(out["adapter"]["model"]["weight"], model.weight.detach())
    assert out["adapter"]["n"] == 1
    encode_state({"adapter": Deferred(build)})  # encode_state calls it at once
    assert calls == ["built", "built"]

"""Format v3 shards: bit-exact round trip, safetensors compatibility, write-time refusals."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import crc32c
import pytest
import torch
from safetensors import safe_open

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ShardIntegrityError, StateEncodingError
from lm_resiliency.persistence import ShardStore, TrustStatus
from lm_resiliency.persistence.format import METADATA_KEY, SAFETENSORS_DTYPES

torch.set_num_threads(1)


def _state(seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(17, 5, generator=g),
        torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        torch.randn(3, 3, generator=g).to(torch.bfloat16),
        torch.randn(9, generator=g).to(torch.float16),
        torch.tensor([True, False, True]),
        torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        torch.empty(0, 4),
        torch.tensor(3.5, dtype=torch.float64),
    ]
    names = ["model.w", "opt.step_counts", "model.bf", "model.half", "mask", "bytes", "empty", "lr"]
    return tensors, names


def _arena(tensors: list[torch.Tensor], names: list[str]) -> tuple[Layout, torch.Tensor]:
    layout = Layout.from_tensors(tensors, names)
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for view, t in zip(layout.views(arena), tensors, strict=True):
        view.copy_(t)
    return layout, arena


def _store(tmp_path: Path, *, integrity: bool = True, **kw: object) -> ShardStore:
    return ShardStore(
        tmp_path / "ckpt",
        run_id="run-a",
        topology="f" * 64,
        rank=0,
        verify_integrity=integrity,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("integrity", [True, False])
@pytest.mark.parametrize("chunk_bytes", [64, 64 << 20])
def test_round_trip_is_bit_exact(tmp_path: Path, integrity: bool, chunk_bytes: int) -> None:
    tensors, names = _state()
    layout, arena = _arena(tensors, names)
    store = _store(tmp_path, integrity=integrity, chunk_bytes=chunk_bytes)
    doc = {"position": {"epoch": 2, "batch": 41}, "lr": [0.1, 1e-300], "name": "ünï"}
    path = store.write(
        owner_rank=3,
        step=40,
        layout=layout,
        arena=arena,
        state_document=doc,
        trust=TrustStatus.CANDIDATE,
    )
    assert path == store.topology_path / "step-40" / "rank-3.safetensors"
    loaded = store.read(owner_rank=3, step=40)
    assert torch.equal(loaded.arena, arena)
    assert loaded.layout == layout
    assert loaded.state_document == doc
    assert loaded.trust is TrustStatus.CANDIDATE
    assert (loaded.owner_rank, loaded.step, loaded.path) == (3, 40, path)
    for got, want in zip(layout.views(loaded.arena), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert store.steps(3) == [40] and store.steps(0) == []


def test_file_opens_with_safetensors_and_lists_every_tensor(tmp_path: Path) -> None:
    tensors, names = _state(1)
    layout, arena = _arena(tensors, names)
    path = _store(tmp_path).write(
        owner_rank=0, step=7, layout=layout, arena=arena, state_document={"k": 1}
    )
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(names)
        for name, want in zip(names, tensors, strict=True):
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and torch.equal(got, want)
        meta = json.loads(f.metadata()[METADATA_KEY])
    assert meta["format_version"] == 3
    assert (meta["run_id"], meta["owner_rank"], meta["step"]) == ("run-a", 0, 7)
    assert meta["state"] == {"k": 1} and meta["layout"]["digest"] == layout.digest
    assert len(meta["integrity"]["chunks"]) == 1
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0  # data starts 8-byte aligned
    assert raw[8 + n :] == arena.numpy().tobytes()


def test_every_safetensors_dtype_round_trips(tmp_path: Path) -> None:
    tensors = [torch.arange(6).reshape(2, 3).to(dt) for dt in SAFETENSORS_DTYPES]
    names = [str(dt) for dt in SAFETENSORS_DTYPES]
    layout, arena = _arena(tensors, names)
    store = _store(tmp_path)
    path = store.write(owner_rank=0, step=1, layout=layout, arena=arena, state_document={})
    loaded = store.read(owner_rank=0, step=1)
    assert torch.equal(loaded.arena, arena)
    with safe_open(str(path), "pt") as f:
        for name, want in zip(names, tensors, strict=True):
            assert torch.equal(f.get_tensor(name).view(torch.uint8), want.view(torch.uint8))


def test_empty_state_round_trips(tmp_path: Path) -> None:
    layout, arena = _arena([], [])
    store = _store(tmp_path)
    store.write(owner_rank=0, step=0, layout=layout, arena=arena, state_document={"only": "json"})
    loaded = store.read(owner_rank=0, step=0)
    assert loaded.arena.numel() == 0 and loaded.state_document == {"only": "json"}


def test_read_into_a_provided_arena(tmp_path: Path) -> None:
    tensors, names = _state(2)
    layout, arena = _arena(tensors, names)
    store = _store(tmp_path, chunk_bytes=100)
    store.write(owner_rank=0, step=3, layout=layout, arena=arena, state_document={})
    target = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    loaded = store.read(owner_rank=0, step=3, into=target)
    assert loaded.arena is target and torch.equal(target, arena)


def test_a_shard_reader_reads_any_range_and_hands_out_the_stored_checksums(
    tmp_path: Path,
) -> None:
    tensors, names = _state(4)
    layout, arena = _arena(tensors, names)
    store = _store(tmp_path, chunk_bytes=64)
    store.write(owner_rank=0, step=6, layout=layout, arena=arena, state_document={"k": 2})
    with store.open_reader(owner_rank=0, step=6) as reader:
        assert reader.layout.digest == layout.digest and reader.state_document == {"k": 2}
        assert reader.total_bytes == layout.total_bytes
        piece = torch.empty(50, dtype=torch.uint8)
        reader.read_into(70, piece)
        assert torch.equal(piece, arena[70:120])
        chunk, crcs = reader.checksums() or (0, [])
        expected = [crc32c.crc32c(arena[i : i + 64].numpy()) for i in range(0, arena.numel(), 64)]
        assert chunk == 64 and crcs == expected
        with pytest.raises(ValueError, match="outside the shard"):
            reader.read_into(layout.total_bytes - 10, piece)
        assert torch.equal(reader.read_all(), arena)
    with pytest.raises(ValueError, match="is closed"):
        reader.read_into(0, piece)
    plain = _store(tmp_path / "plain", integrity=False)
    plain.write(owner_rank=0, step=6, layout=layout, arena=arena, state_document={})
    with plain.open_reader(owner_rank=0, step=6) as reader:
        assert reader.checksums() is None


def test_crc_failure_names_the_damaged_chunk(tmp_path: Path) -> None:
    tensors, names = _state(3)
    layout, arena = _arena(tensors, names)
    store = _store(tmp_path, chunk_bytes=64)
    path = store.write(owner_rank=0, step=5, layout=layout, arena=arena, state_document={})
    raw = bytearray(path.read_bytes())
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    raw[data_start + 64 + 3] ^= 0x10  # inside chunk 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardIntegrityError) as info:
        store.read(owner_rank=0, step=5)
    assert info.value.reason == "checksum_mismatch"
    assert "data chunk 1 (bytes 64..128)" in str(info.value)


def _no_files_left(store: ShardStore) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), store.topology_path)
        for d, _, files in os.walk(store.topology_path)
        for f in files
        if f.endswith((".safetensors", ".tmp"))
    )


def test_unstorable_dtype_fails_the_write_before_anything_is_written(tmp_path: Path) -> None:
    layout, arena = _arena([torch.ones(2, dtype=torch.complex128)], ["z"])
    store = _store(tmp_path)
    with pytest.raises(StateEncodingError, match=r"tensor 'z' has dtype torch.complex128.*convert"):
        store.write(owner_rank=0, step=1, layout=layout, arena=arena, state_document={})
    assert _no_files_left(store) == [] and store.steps(0) == []


@pytest.mark.parametrize(
    ("doc", "match"),
    [({"x": float("nan")}, "not strict JSON"), ({"x": object()}, "not strict JSON"), ([1], "dict")],
)
def test_non_json_state_fails_the_write(tmp_path: Path, doc: object, match: str) -> None:
    layout, arena = _arena([torch.ones(2)], ["w"])
    store = _store(tmp_path)
    with pytest.raises(StateEncodingError, match=match):
        store.write(owner_rank=0, step=1, layout=layout, arena=arena, state_document=doc)  # type: ignore[arg-type]
    assert _no_files_left(store) == []


def test_directories_and_files_are_owner_only(tmp_path: Path) -> None:
    layout, arena = _arena([torch.ones(2)], ["w"])
    store = _store(tmp_path)
    path = store.write(owner_rank=0, step=1, layout=layout, arena=arena, state_document={})
    for p in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert p.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    manifest = json.loads((store.topology_path.parent / "run.json").read_text())
    assert manifest["run_id"] == "run-a"
    topo = json.loads((store.topology_path / "topology.json").read_text())
    assert topo["topology"] == "f" * 64

"""Corruption matrix: every damaged, foreign or misplaced shard is refused with its reason."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lm_resiliency.capture import Layout
from lm_resiliency.errors import (
    IdentityMismatch,
    IntegrityError,
    ShardIdentityMismatch,
    ShardIntegrityError,
    ShardUnavailable,
    UnsafePathError,
)
from lm_resiliency.faults.disk import data_start, edit_document, flip_data_byte
from lm_resiliency.persistence import ShardStore

torch.set_num_threads(1)
TOPO = "a" * 64


def _layout() -> tuple[Layout, torch.Tensor]:
    tensors = [torch.arange(64, dtype=torch.float32), torch.arange(10, dtype=torch.int16)]
    layout = Layout.from_tensors(tensors, ["w", "b"])
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for v, t in zip(layout.views(arena), tensors, strict=True):
        v.copy_(t)
    return layout, arena


def _store(root: Path, *, run_id: str = "run-1", topology: str = TOPO, integrity: bool = True):
    return ShardStore(root, run_id=run_id, topology=topology, rank=0, verify_integrity=integrity)


def _write(store: ShardStore, *, owner: int = 0, step: int = 3) -> Path:
    layout, arena = _layout()
    return store.write(
        owner_rank=owner, step=step, layout=layout, arena=arena, state_document={"batch": 7}
    )


_data_start = data_start
_flip_data = flip_data_byte


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])


def _trailing(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 8)


def _header_past_end(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) + 100)
    path.write_bytes(bytes(raw))


def _header_huge(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(raw))


def _malformed_json(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:10] = b"[{"
    path.write_bytes(bytes(raw))


_edit_document = edit_document


def _state_value_changed(path: Path) -> None:
    _edit_document(path, lambda d: d["state"].update(batch=8))


def _v2(path: Path) -> None:
    _edit_document(path, lambda d: d.update(format_version=2))


def _v4(path: Path) -> None:
    _edit_document(path, lambda d: d.update(format_version=4))


def _owner_forged(path: Path) -> None:
    _edit_document(path, lambda d: d.update(owner_rank=5))


def _no_checksums(path: Path) -> None:
    _edit_document(path, lambda d: d.update(integrity=None), fix_crc=True)


CASES = [
    ("flipped data byte", _flip_data, ShardIntegrityError, "checksum_mismatch", "data chunk 0"),
    ("truncated file", _truncate, ShardUnavailable, "truncated", "but the header needs"),
    ("trailing bytes", _trailing, ShardUnavailable, "size_mismatch", "8 bytes beyond"),
    ("header past end", _header_past_end, ShardUnavailable, "header_out_of_bounds", "past the end"),
    ("header too large", _header_huge, ShardUnavailable, "header_too_large", "exceeds"),
    ("malformed json", _malformed_json, ShardUnavailable, "malformed_header", "not valid JSON"),
    ("state edited", _state_value_changed, ShardIntegrityError, "checksum_mismatch", "metadata"),
    ("format v2", _v2, ShardUnavailable, "legacy_format", "release that wrote them"),
    ("format v4", _v4, ShardUnavailable, "unsupported_version", "upgrade lm-resiliency"),
    ("owner edited", _owner_forged, ShardIntegrityError, "checksum_mismatch", "damaged header"),
    (
        "checksums stripped",
        _no_checksums,
        ShardIntegrityError,
        "checksum_missing",
        "verify_integrity",
    ),
]


@pytest.mark.parametrize(
    ("damage", "exc", "reason", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_damaged_shard_is_unavailable_with_reason(
    tmp_path: Path, damage: Callable[[Path], None], exc: type, reason: str, phrase: str
) -> None:
    store = _store(tmp_path)
    path = _write(store)
    assert store.read(owner_rank=0, step=3).state_document == {"batch": 7}
    damage(path)
    with pytest.raises(exc) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == reason
    assert phrase in str(info.value) and str(path) in str(info.value)


def test_wrong_run_id_is_an_identity_mismatch(tmp_path: Path) -> None:
    src = _write(_store(tmp_path, run_id="run-1"))
    other = _store(tmp_path, run_id="run-2")
    dst = other.path_for(0, 3)
    dst.parent.mkdir(mode=0o700)
    shutil.copyfile(src, dst)
    with pytest.raises(ShardIdentityMismatch) as info:
        other.read(owner_rank=0, step=3)
    assert isinstance(info.value, IdentityMismatch)
    assert info.value.reason == "identity_run"
    assert "run_id='run-1'" in str(info.value) and "run_id='run-2'" in str(info.value)


def test_wrong_topology_is_an_identity_mismatch(tmp_path: Path) -> None:
    src = _write(_store(tmp_path))
    other = _store(tmp_path, topology="b" * 64)
    dst = other.path_for(0, 3)
    dst.parent.mkdir(mode=0o700)
    shutil.copyfile(src, dst)
    with pytest.raises(ShardIdentityMismatch) as info:
        other.read(owner_rank=0, step=3)
    assert info.value.reason == "identity_topology"


def test_wrong_owner_rank_is_an_identity_mismatch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    src = _write(store, owner=0)
    shutil.copyfile(src, store.path_for(1, 3))
    assert store.steps(1) == [3]  # listed, but never loadable
    with pytest.raises(ShardIdentityMismatch) as info:
        store.read(owner_rank=1, step=3)
    assert info.value.reason == "identity_owner"
    assert "owner_rank=0" in str(info.value) and "owner_rank=1" in str(info.value)


def test_file_moved_to_another_step_is_an_identity_mismatch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    src = _write(store, step=3)
    dst = store.path_for(0, 4)
    dst.parent.mkdir(mode=0o700)
    os.rename(src, dst)
    with pytest.raises(ShardIdentityMismatch) as info:
        store.read(owner_rank=0, step=4)
    assert info.value.reason == "identity_step"
    with pytest.raises(ShardUnavailable) as gone:
        store.read(owner_rank=0, step=3)
    assert gone.value.reason == "missing"


def test_missing_checksums_when_integrity_is_required(tmp_path: Path) -> None:
    _write(_store(tmp_path, integrity=False))
    strict = _store(tmp_path, integrity=True)
    with pytest.raises(ShardIntegrityError) as info:
        strict.read(owner_rank=0, step=3)
    assert isinstance(info.value, IntegrityError)
    assert info.value.reason == "checksum_missing"
    assert "checksummed generation" in str(info.value)
    loaded = _store(tmp_path, integrity=False).read(owner_rank=0, step=3)
    assert loaded.state_document == {"batch": 7}


def test_torch_save_file_is_legacy_with_advice(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _write(store)
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == "legacy_format"
    assert "zip archive" in str(info.value) and "durable checkpoint" in str(info.value)


def test_foreign_safetensors_file_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _write(store)
    save_file({"w": torch.ones(3)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == "foreign_format"
    assert "not written by lm-resiliency" in str(info.value)


def test_symlink_planted_in_place_of_a_shard_is_never_followed(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    path = _write(store, step=3)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(path, outside)  # a perfectly valid shard, reached only through the link
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == "symlink" and "never follows links" in str(info.value)
    assert store.steps(0) == []


def test_symlinked_step_directory_pointing_outside_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path / "ckpt")
    path = _write(store, step=3)
    outside = tmp_path / "elsewhere"
    shutil.copytree(path.parent, outside)
    shutil.rmtree(path.parent)
    path.parent.symlink_to(outside, target_is_directory=True)
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == "symlink"
    assert store.steps(0) == []
    # Writing through the link is refused too, and nothing lands outside.
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(UnsafePathError, match="symlink"):
        _write(store, step=3)
    assert sorted(p.name for p in outside.iterdir()) == before


def test_manifest_naming_another_run_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path, run_id="run-1")
    manifest = store.topology_path.parent / "run.json"
    manifest.write_text(json.dumps({"kind": "lm_resiliency.run", "version": 1, "run_id": "x"}))
    with pytest.raises(IdentityMismatch, match="run_id='x', not 'run-1'"):
        _store(tmp_path, run_id="run-1")


@pytest.mark.parametrize("integrity", [True, False])
def test_every_single_bit_flip_in_the_header_is_refused(tmp_path: Path, integrity: bool) -> None:
    store = _store(tmp_path, integrity=integrity)
    path = _write(store)
    good = path.read_bytes()
    end = _data_start(good) if not integrity else len(good)  # data flips need chunk CRCs
    reasons = set()
    for pos in range(end):
        for bit in (0x01, 0x20, 0x80):
            bad = bytearray(good)
            bad[pos] ^= bit
            path.write_bytes(bytes(bad))
            with pytest.raises(ShardUnavailable) as info:
                store.read(owner_rank=0, step=3)
            reasons.add(info.value.reason)
    path.write_bytes(good)
    assert store.read(owner_rank=0, step=3).state_document == {"batch": 7}
    assert {"malformed_header", "header_out_of_bounds", "tensor_table"} <= reasons
    assert "checksum_mismatch" in reasons  # the document CRC exists even without integrity


def test_unreadable_shard_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = _write(store)
    path.unlink()
    path.mkdir()  # a directory where the shard should be
    with pytest.raises(ShardUnavailable) as info:
        store.read(owner_rank=0, step=3)
    assert info.value.reason == "not_a_file"

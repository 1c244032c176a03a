"""Hypothesis fuzzing of genuine files: every mutation of a shard's header and metadata
document, or of a status sidecar, either loads the original or is refused with a named
reason, quickly."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ShardUnavailable, SidecarUnavailable
from lm_resiliency.faults.disk import data_start
from lm_resiliency.memory.scan import scan_memory
from lm_resiliency.memory.slotfile import (
    SlotFile,
    SlotIdentity,
    SlotReason,
    SlotUnavailable,
    arena_crcs,
)
from lm_resiliency.persistence import ShardStore, UnavailableReason
from lm_resiliency.persistence.sidecar import read_status
from lm_resiliency.state import encode_state

torch.set_num_threads(1)
TOPO = "f" * 64
REASONS = {r.value for r in UnavailableReason}
SLOT_REASONS = {r.value for r in SlotReason}
_SETTINGS = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _genuine(root: Path) -> tuple[ShardStore, Path, torch.Tensor]:
    tensors = [torch.arange(300, dtype=torch.float32), torch.arange(11, dtype=torch.int16)]
    layout = Layout.from_tensors(tensors, ["w", "b"])
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for v, t in zip(layout.views(arena), tensors, strict=True):
        v.copy_(t)
    store = ShardStore(root, run_id="fuzz", topology=TOPO, rank=0, verify_integrity=True)
    path = store.write(
        owner_rank=0, step=4, layout=layout, arena=arena, state_document={"schema": "x"}
    )
    store.sidecar.mark_verified(4, (0,))
    return store, path, arena


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, torch.Tensor, bytes]:
    root = tmp_path_factory.mktemp("fuzz")
    _, path, arena = _genuine(root)
    (sidecar,) = root.glob("run-*/topo-*/status-rank-0.json")
    return root, path.read_bytes(), arena, sidecar.read_bytes()


def _flips(limit: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.lists(
        st.tuples(st.integers(0, limit - 1), st.integers(1, 255)), min_size=1, max_size=6
    )


@_SETTINGS
@given(data=st.data())
def test_every_header_mutation_loads_the_original_or_names_its_reason(genuine, data) -> None:
    root, raw, arena, _ = genuine
    header_end = data_start(raw)
    flips = data.draw(_flips(header_end + 64))  # header, document, and the first data bytes
    damaged = bytearray(raw)
    for offset, mask in flips:
        damaged[offset] ^= mask
    (path,) = root.glob("run-*/topo-*/step-4/rank-0.safetensors")
    path.write_bytes(bytes(damaged))
    try:
        store = ShardStore(root, run_id="fuzz", topology=TOPO, rank=0, verify_integrity=True)
        try:
            loaded = store.read(owner_rank=0, step=4)
        except ShardUnavailable as exc:
            assert exc.reason in REASONS, exc
        else:
            assert torch.equal(loaded.arena, arena)
    finally:
        path.write_bytes(raw)


@_SETTINGS
@given(data=st.data())
def test_every_sidecar_mutation_reads_the_original_or_fails_closed(genuine, data) -> None:
    root, _, _, sidecar_raw = genuine
    flips = data.draw(_flips(len(sidecar_raw)))
    damaged = bytearray(sidecar_raw)
    for offset, mask in flips:
        damaged[offset] ^= mask
    (sidecar,) = root.glob("run-*/topo-*/status-rank-0.json")
    sidecar.write_bytes(bytes(damaged))
    try:
        fd = os.open(sidecar.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            status = read_status(
                fd, run_id="fuzz", topology=TOPO, rank=0, where=str(sidecar), retry_s=0.0
            )
        except SidecarUnavailable as exc:
            assert exc.reason in {"malformed", "identity", "schema", "trust"}, exc
        else:
            assert status is not None and status.verified_history == (4,)
        finally:
            os.close(fd)
    finally:
        sidecar.write_bytes(sidecar_raw)


# -- the memory tier's commit record -----------------------------------------------------


@pytest.fixture(scope="module")
def genuine_slot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, SlotIdentity]:
    folder = tmp_path_factory.mktemp("slot")
    folder.chmod(0o700)
    tensors = [torch.arange(300, dtype=torch.float32)]
    layout = Layout.from_tensors(tensors, ["w"])
    encoded = encode_state({"w": tensors[0], "step": 4})
    identity = SlotIdentity("fuzz", TOPO, 0, 0, "own")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        slot = SlotFile.create(fd, "own-0.slot", layout.total_bytes, where=str(folder))
        slot.arena.copy_(tensors[0].view(torch.uint8))
        crcs = arena_crcs(slot.arena)
        slot.commit(identity, generation=1, step=4, timeline=None, layout=layout,
                    state=encoded.document, crcs=crcs)  # fmt: skip
        slot.release()
    finally:
        os.close(fd)
    path = folder / "own-0.slot"
    return path, path.read_bytes(), identity


def _open_slot(path: Path, identity: SlotIdentity) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        slot, _ = SlotFile.open_existing(fd, path.name, identity, where=str(path))
        slot.release()
    finally:
        os.close(fd)


@_SETTINGS
@given(data=st.data())
def test_every_slot_prefix_or_record_mutation_opens_or_names_its_reason(genuine_slot, data):
    path, raw, identity = genuine_slot
    record_at = struct.unpack_from("<Q", raw, 40)[0]
    spots = st.one_of(st.integers(0, 63), st.integers(record_at, len(raw) - 1))
    flips = data.draw(st.lists(st.tuples(spots, st.integers(1, 255)), min_size=1, max_size=6))
    damaged = bytearray(raw)
    for offset, mask in flips:
        damaged[offset] ^= mask
    path.write_bytes(bytes(damaged))
    try:
        try:
            _open_slot(path, identity)
        except SlotUnavailable as exc:
            assert exc.reason in SLOT_REASONS, exc
        scan = scan_memory(path.parent)  # the tools never raise either
        assert scan.error is None
    finally:
        path.write_bytes(raw)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@_SETTINGS
@given(doc=_JSON, keep=st.booleans())
def test_any_json_as_a_commit_record_is_refused_with_a_slot_reason(genuine_slot, doc, keep):
    """A record whose CRC matches but whose JSON is anything at all (or a genuine record
    with one value replaced) raises ``SlotUnavailable`` only."""
    path, raw, identity = genuine_slot
    record_at, record_bytes = struct.unpack_from("<QQ", raw, 40)
    if keep:
        record = json.loads(raw[record_at : record_at + record_bytes])
        key = sorted(record)[len(json.dumps(doc)) % len(record)]
        assume(record[key] != doc)  # a genuine record would (rightly) open
        record[key] = doc
        doc = record
    blob = json.dumps(doc).encode()
    damaged = bytearray(raw[:record_at]) + blob
    struct.pack_into("<QI", damaged, 48, len(blob), crc32c.crc32c(blob))
    path.write_bytes(bytes(damaged))
    try:
        with pytest.raises(SlotUnavailable) as info:
            _open_slot(path, identity)
        assert info.value.reason in SLOT_REASONS
    finally:
        path.write_bytes(raw)

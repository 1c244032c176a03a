"""Hypothesis fuzzing of genuine files: every mutation of a shard's header and metadata
document, or of a status sidecar, either loads the original or is refused with a named
reason, quickly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ShardUnavailable, SidecarUnavailable
from lm_resiliency.faults.disk import data_start
from lm_resiliency.persistence import ShardStore, UnavailableReason
from lm_resiliency.persistence.sidecar import read_status

torch.set_num_threads(1)
TOPO = "f" * 64
REASONS = {r.value for r in UnavailableReason}
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
    store.mark_verified(4, (0,))
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

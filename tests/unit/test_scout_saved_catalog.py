"""SCOUT's saved catalog: written through the real trust ledger, read back strictly.

A restarted job reads the shapes its previous process recorded; whatever it reads
back is validated (strict JSON, the document's structure, the model layout), and a
catalog it cannot use is ignored with a log line naming why.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.checkpointing.disk import LocalDisk
from lm_resiliency.checkpointing.trust import TrustLedger
from lm_resiliency.detection.blocks import partition
from lm_resiliency.detection.planner import Planner
from lm_resiliency.detection.saved_catalog import (
    CatalogError,
    CatalogKeeper,
    SavedCatalog,
    layout_of,
)
from lm_resiliency.detection.signature import Recorder


class _Ledger(TrustLedger):
    """The real trust ledger over a real node-local store; ``close`` also releases its lock."""

    def __init__(self, folder: Path) -> None:
        cfg = InMemoryCkptConfig(disk_folder=folder)
        self.disk = LocalDisk(cfg, run_id="catalog-test", topology="t", rank=0)
        super().__init__(0, self.disk, serves_owner=None, persist=lambda step: None)

    def close(self) -> None:
        super().close()
        self.disk.close()


def _ledger(folder: Path) -> _Ledger:
    return _Ledger(folder)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 3))


def _recorded(model: nn.Module) -> tuple[Recorder, list]:
    blocks = partition(model)
    recorder = Recorder([b.module for b in blocks], count_distinct=False, one_shot=True)
    model(torch.randint(0, 7, (4, 5)))  # token ids 0..6
    return recorder, blocks


def _catalog_file(folder: Path) -> Path:
    (found,) = folder.rglob("scout-catalog-rank-0.json")
    return found


def test_a_fresh_process_plans_the_shapes_its_predecessor_recorded(tmp_path: Path) -> None:
    model = _model()
    recorder, blocks = _recorded(model)
    ledger = _ledger(tmp_path)
    keeper = CatalogKeeper(ledger, layout=layout_of(blocks, None), recorder=recorder, dynamic=None)
    keeper.maybe_save([])
    ledger.wait()
    doc = json.loads(_catalog_file(tmp_path).read_text())
    assert doc["kind"] == "lm_resiliency.scout_catalog" and len(doc["dense"]) == 3
    assert doc["dense"][0]["args"][0] == {
        "k": "t", "shape": [4, 5], "dtype": "int64", "rg": False, "range": [0, 7],
    }  # fmt: skip
    assert "tensor" not in json.dumps(doc).lower()  # shapes and structures only
    ledger.close()

    # The restarted process: new model object, nothing recorded, the same folder.
    fresh = _model()
    blocks2 = partition(fresh)
    recorder2 = Recorder([b.module for b in blocks2], count_distinct=False, one_shot=True)
    ledger2 = _ledger(tmp_path)
    keeper2 = CatalogKeeper(
        ledger2, layout=layout_of(blocks2, None), recorder=recorder2, dynamic=None
    )
    planner = Planner(blocks2, recorder2, None, None, seed=0)
    assert planner.plan_sweep(seq=1, round_=1, classes={"dense"})["dense"] is None  # no shapes
    planner.saved = keeper2.load(len(blocks2))
    spec = planner.plan_sweep(seq=2, round_=1, classes={"dense"})
    assert spec["dense"]["args"][0]["shape"] == [4, 5, 8]
    assert planner.plan_sweep(seq=3, round_=0, classes={"dense"})["dense"] == doc["dense"][0]
    # Unchanged shapes are not written again; a changed block rewrites the file.
    keeper2.maybe_save([])
    ledger2.wait()
    before = _catalog_file(tmp_path).stat().st_mtime_ns
    keeper2.maybe_save([])
    ledger2.wait()
    assert _catalog_file(tmp_path).stat().st_mtime_ns == before
    ledger2.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"kind": "lm_resiliency.scout_catalog", "kind": "x"}', "not strict JSON"),
        (b'{"kind": "lm_resiliency.scout_catalog", "version": NaN}', "not strict JSON"),
        (b"\xff\xfe", "not strict JSON"),
        (b'{"kind": "lm_resiliency.scout_catalog", "version": 2}', "version 2"),
        (b'{"kind": "other"}', "not a SCOUT catalog"),
    ],
)
def test_a_malformed_catalog_is_ignored_with_a_log_line_naming_the_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes, why: str
) -> None:
    model = _model()
    recorder, blocks = _recorded(model)
    ledger = _ledger(tmp_path)
    keeper = CatalogKeeper(ledger, layout=layout_of(blocks, None), recorder=recorder, dynamic=None)
    keeper.maybe_save([])
    ledger.wait()
    _catalog_file(tmp_path).write_bytes(body)
    with caplog.at_level(logging.WARNING):
        assert keeper.load(len(blocks)) is None
    assert why in caplog.text and "SCOUT ignores its saved catalog" in caplog.text
    ledger.close()


def test_a_catalog_of_another_layout_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model()
    recorder, blocks = _recorded(model)
    ledger = _ledger(tmp_path)
    CatalogKeeper(
        ledger, layout=layout_of(blocks, None), recorder=recorder, dynamic=None
    ).maybe_save([])
    other = partition(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.Linear(16, 3)))
    keeper = CatalogKeeper(ledger, layout=layout_of(other, None), recorder=None, dynamic=None)
    with caplog.at_level(logging.WARNING):
        assert keeper.load(len(other)) is None
    assert "another model layout" in caplog.text
    ledger.close()


def test_signature_documents_are_checked_field_by_field() -> None:
    good = {"args": [{"k": "t", "shape": [2], "dtype": "float32", "rg": True, "range": None}]}
    good |= {"kwargs": [], "autocast": [False, "float32"]}
    doc = {"kind": "lm_resiliency.scout_catalog", "version": 1, "layout": "0" * 16}
    assert SavedCatalog.from_json({**doc, "dense": [good, None], "dynamic": []}).dense[1] is None
    bad_shape = {**good, "args": [{**good["args"][0], "shape": [2.5]}]}
    bad_dtype = {**good, "args": [{**good["args"][0], "dtype": "Tensor"}]}
    for sig, words in ((bad_shape, "ints >= 0"), (bad_dtype, "dtype"), ({"args": []}, "keys")):
        with pytest.raises(CatalogError, match=words) as info:
            SavedCatalog.from_json({**doc, "dense": [sig], "dynamic": []})
        assert "dense[0]" in str(info.value)

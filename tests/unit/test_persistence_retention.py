"""Retention: newest K generations plus the newest recovery-verified one, per owner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_resiliency.capture import Layout
from lm_resiliency.errors import ConfigError
from lm_resiliency.persistence import ShardStore, TrustStatus
from lm_resiliency.persistence.retention import MAX_SPARES, plan_retention

torch.set_num_threads(1)


def _arena(n: int, fill: int) -> tuple[Layout, torch.Tensor]:
    layout = Layout.from_tensors([torch.empty(n, dtype=torch.int32)], ["w"])
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    layout.views(arena)[0].fill_(fill)
    return layout, arena


def _store(tmp_path: Path, **kw: object) -> ShardStore:
    return ShardStore(
        tmp_path,
        run_id="r",
        topology="t",
        rank=0,
        verify_integrity=True,
        **kw,  # type: ignore[arg-type]
    )


def _write(store: ShardStore, step: int, *, owner: int = 0, n: int = 256, **kw: object) -> None:
    layout, arena = _arena(n, step)
    store.write(owner_rank=owner, step=step, layout=layout, arena=arena, state_document={}, **kw)  # type: ignore[arg-type]


def _temps(store: ShardStore) -> list[Path]:
    return sorted(store.topology_path.rglob(".*.tmp"))


def test_every_candidate_newer_than_the_verified_step_survives(tmp_path: Path) -> None:
    # SCOUT's K-recipe rule verifies candidates oldest first, a rotation after their capture,
    # and this rank may learn of a promotion late: any pending candidate can be the one
    # verified next, so all of them must still be there when it is.
    store = _store(tmp_path)
    _write(store, 10, trust=TrustStatus.RECOVERY_VERIFIED)
    for step in (20, 30, 40, 50):
        _write(store, step, trust=TrustStatus.CANDIDATE)
    assert store.steps(0) == [10, 20, 30, 40, 50]
    store.sidecar.mark_verified(20)  # promoted: 10 is superseded
    _write(store, 60, trust=TrustStatus.CANDIDATE)
    assert store.steps(0) == [20, 30, 40, 50, 60]
    store.sidecar.mark_rejected(40, "SDC")  # a rejected candidate is no longer protected ...
    store.sidecar.mark_rejected(30, "SDC")  # ... and the verified step stays
    _write(store, 70, trust=TrustStatus.CANDIDATE)
    assert store.steps(0) == [20, 50, 60, 70]


def test_two_lagging_views_of_one_owner_never_remove_the_step_verified_next(
    tmp_path: Path,
) -> None:
    # The owner and the rank holding its replica retain the same owner's files in one
    # folder, each from its own sidecar. The replica holder still believes 10 is the newest
    # verified step; the owner already promoted 20. Between them they used to remove 30,
    # which the next clean check verifies: then no verified step was left on disk.
    owner = _store(tmp_path)
    holder = ShardStore(tmp_path, run_id="r", topology="t", rank=1, verify_integrity=True)
    _write(owner, 10, trust=TrustStatus.RECOVERY_VERIFIED)
    for step in (20, 30, 40):
        _write(owner, step, trust=TrustStatus.CANDIDATE)
    owner.sidecar.mark_verified(20)
    holder.sidecar.mark_verified(10)
    _write(holder, 50, trust=TrustStatus.CANDIDATE)  # the holder's pass: 20 is next, it thinks
    _write(owner, 60, trust=TrustStatus.CANDIDATE)  # the owner's pass: 10 is superseded
    assert owner.steps(0) == [20, 30, 40, 50, 60]
    owner.sidecar.mark_verified(30)  # the promotion both views lagged behind: 30 is there


def test_plan_keeps_newest_k_and_newest_verified() -> None:
    assert plan_retention([1, 2, 3, 4, 5], keep=2, verified_step=None) == [1, 2, 3]
    assert plan_retention([1, 2, 3, 4, 5], keep=2, verified_step=2) == [1, 3]
    assert plan_retention([5, 1, 3], keep=3, verified_step=4) == []
    assert plan_retention([1, 2, 3], keep=2, verified_step=3) == [1]
    assert plan_retention([1, 2, 3, 4, 5], keep=2, verified_step=1, candidates=[2]) == [3]
    assert plan_retention([1, 2, 3, 4, 5, 6], keep=2, verified_step=1, candidates=[2, 3]) == [4]


@pytest.mark.parametrize("recycle", [True, False])
def test_keeps_exactly_the_newest_k_generations(tmp_path: Path, recycle: bool) -> None:
    store = _store(tmp_path, recycle_files=recycle)
    for step in range(1, 7):
        _write(store, step * 10)
    assert store.steps(0) == [50, 60]
    assert sorted(p.name for p in store.topology_path.iterdir() if p.name.startswith("step-")) == [
        "step-50",
        "step-60",
    ]
    for step in (50, 60):
        loaded = store.read(owner_rank=0, step=step)
        assert torch.equal(
            loaded.layout.views(loaded.arena)[0], torch.full((256,), step, dtype=torch.int32)
        )
    assert len(_temps(store)) == (1 if recycle else 0)  # one parked spare at most per owner
    store.close()
    assert _temps(store) == []


def test_keep_three(tmp_path: Path) -> None:
    store = _store(tmp_path, keep_generations=3)
    for step in range(1, 8):
        _write(store, step)
    assert store.steps(0) == [5, 6, 7]


def test_newest_verified_generation_survives(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1)
    _write(store, 2)
    store.sidecar.mark_verified(2)
    for step in range(3, 7):
        _write(store, step)
    assert store.steps(0) == [2, 5, 6]
    store.sidecar.mark_verified(5)
    _write(store, 7)
    assert store.steps(0) == [5, 6, 7]  # 2 is no longer the newest verified
    _write(store, 8)
    assert store.steps(0) == [5, 7, 8]


def test_shard_written_as_verified_survives_without_a_sidecar_mark(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1, owner=8)
    _write(store, 2, owner=8, trust=TrustStatus.RECOVERY_VERIFIED)
    for step in range(3, 6):
        _write(store, step, owner=8, trust=TrustStatus.CANDIDATE)
    # 3 stays: a candidate newer than the verified 2 (the next SCOUT can promote).
    assert store.steps(8) == [2, 3, 4, 5]
    # A new store (restart) learns the trust from the file header: 2 is verified, 3-5
    # are still pending candidates; the unverified 1 is gone.
    again = _store(tmp_path)
    _write(again, 6, owner=8)
    assert again.steps(8) == [2, 3, 4, 5, 6]
    assert again.read(owner_rank=8, step=2).trust is TrustStatus.RECOVERY_VERIFIED
    again.sidecar.mark_verified(4)  # promoted: 2 and 3 are older than the verified step
    _write(again, 7, owner=8)
    assert again.steps(8) == [4, 5, 6, 7]


def test_retention_is_per_owner(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1, owner=0)
    _write(store, 1, owner=8)
    for step in range(2, 6):
        _write(store, step, owner=0)
    assert store.steps(0) == [4, 5]
    assert store.steps(8) == [1]  # owner 8 has no newer generation yet: untouched
    assert store.read(owner_rank=8, step=1).step == 1


def test_another_ranks_store_never_removes_files_it_did_not_retire(tmp_path: Path) -> None:
    a = _store(tmp_path)
    b = ShardStore(tmp_path, run_id="r", topology="t", rank=1, verify_integrity=True)
    _write(a, 1, owner=0)
    _write(b, 1, owner=1)
    for step in range(2, 5):
        _write(a, step, owner=0)
    assert a.steps(0) == [3, 4] and b.steps(1) == [1]
    assert (a.topology_path / "step-1" / "rank-1.safetensors").is_file()


def test_recycled_files_shrink_and_grow_correctly(tmp_path: Path) -> None:
    store = _store(tmp_path, chunk_bytes=1000)
    sizes = [4096, 4096, 4096, 100, 100, 9000, 10, 9000]
    for step, n in enumerate(sizes, start=1):
        _write(store, step, n=n)
        loaded = store.read(owner_rank=0, step=step)
        assert torch.equal(
            loaded.layout.views(loaded.arena)[0], torch.full((n,), step, dtype=torch.int32)
        )
    assert store.steps(0) == [7, 8]
    assert len(_temps(store)) <= MAX_SPARES


def test_verified_history_is_bounded(tmp_path: Path) -> None:
    store = _store(tmp_path, history_limit=4)
    for step in range(1, 11):
        store.sidecar.mark_verified(step * 10)
    status = store.sidecar.status()
    assert status.verified_history == (70, 80, 90, 100) and status.verified_step == 100
    on_disk = store.sidecar.read_status(0)
    assert on_disk == status


def test_sidecar_records_candidate_verified_and_persisted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 10)
    _write(store, 10, owner=4)
    store.sidecar.mark_candidate(10)
    assert store.sidecar.status().candidate_step == 10
    store.sidecar.mark_verified(10)  # promotion clears the candidate
    store.sidecar.mark_candidate(20)
    status = _store(tmp_path).sidecar.status()  # reloaded from disk by a new store
    assert status.candidate_step == 20
    assert status.verified_step == 10 and status.verified_history == (10,)
    assert status.persisted == {0: 10, 4: 10} and status.persisted_step == 10


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"keep_generations": 0}, "keep_generations=0 must be >= 1"),
        ({"rank": -1}, "rank=-1 must be an int >= 0"),
        ({"run_id": ""}, "run_id='' must be a non-empty string"),
        ({"chunk_bytes": 0}, "chunk_bytes=0"),
    ],
)
def test_invalid_arguments_name_the_field(tmp_path: Path, kw: dict, match: str) -> None:
    args = {"run_id": "r", "topology": "t", "rank": 0, "verify_integrity": True, **kw}
    with pytest.raises(ConfigError, match=match):
        ShardStore(tmp_path, **args)

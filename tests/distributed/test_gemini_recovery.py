"""GEMINI recovery on real Gloo ranks: peer memory, walk-back, verified mode, fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, NoConsistentStep, RankFailures, RecoveryMode
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "h": torch.randn(7, generator=g).half()},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}},
        "sampler": {"epoch": 1, "offset": step * 8, "seed": (rank, step)},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _cfg(tmp: str, **kw) -> InMemoryCkptConfig:
    base = {
        "disk_folder": tmp,
        "disk_flush_interval": 0,
        "replication_chunk_size": 8192,
        "run_id": "recovery-test",
    }
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _peer_memory(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp)) as m:
        for step in (10, 20):
            m.save(_state(rank, step), step)
            m.maybe_wait()
        if rank == 1:
            m.drop_memory()  # a replaced process that rejoined with empty memory
        step = m.find_latest()
        state = m.load(step)
        rep = m.last_restore
        return {
            "step": step,
            "same": _same(state, _state(rank, step)),
            "sources": rep.sources,
            "moved": rep.bytes_moved,
            "phases": sorted(rep.phases_s),
            "not_own": rep.not_own_memory,
        }


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_without_memory_recovers_from_its_peers_memory(tmp_path, world: int) -> None:
    out = run_distributed(_peer_memory, world, args=(str(tmp_path),), timeout_s=150)
    for o in out:
        assert o["step"] == 20
        assert o["same"]
        assert o["sources"][1] == "peer memory"
        assert o["sources"][0] == "own memory"
    assert out[1]["moved"] > 0 and out[0]["moved"] == 0
    assert out[0]["phases"] == ["agree", "decode", "fetch", "prepare", "transfer"]
    # Why rank 1 was not served from own memory, the same on every rank.
    assert all(o["not_own"] == ["rank 1: own memory has no step 20 (it holds none)"] for o in out)


def _persisted_then_restarted(m: InMemoryCheckpointManager, rank: int) -> None:
    """Steps 10 and 20 captured and persisted, then memory lost as in a restarted job."""
    for step in (10, 20):
        m.save(_state(rank, step), step)
        m.maybe_wait()
    m.wait_persisted()
    m.drop_memory()


def _outcome(m: InMemoryCheckpointManager, rank: int, newest: int | None) -> dict:
    state = m.load()
    rep = m.last_restore
    return {
        "newest": newest,
        "loaded": rep.step,
        "walked": rep.walked_back_from,
        "same": _same(state, _state(rank, rep.step)),
        "sources": rep.sources,
    }


def _assert_all_walked_back_to_10_from_own_disk(out: list[dict]) -> None:
    for o in out:
        assert o["newest"] == 20
        assert o["loaded"] == 10 and o["walked"] == [20]
        assert o["same"]
        assert o["sources"] == ["own disk", "own disk"]


def _walk_back(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp, disk_flush_interval=10)) as m:
        _persisted_then_restarted(m, rank)  # only node-local files remain
        newest = m.find_latest()
        if rank == 1:  # damage rank 1's newest shard (its own file and the peer's copy)
            path = m.store().path_for(1, 20)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        torch.distributed.barrier()
        return _outcome(m, rank, newest)


def test_a_corrupted_newest_generation_makes_every_rank_walk_back(tmp_path) -> None:
    out = run_distributed(_walk_back, 2, args=(str(tmp_path),), timeout_s=150)
    _assert_all_walked_back_to_10_from_own_disk(out)


def _verified_walk_back(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp, disk_flush_interval=10)) as m:
        _persisted_then_restarted(m, rank)  # only node-local files remain
        m.trust.mark_verified(10)
        m.trust.mark_verified(20)
        newest = m.find_latest(RecoveryMode.RECOVERY_VERIFIED)
        if rank == 1:  # damage rank 1's newest verified shard (its own file and the peer's copy)
            path = m.store().path_for(1, 20)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        torch.distributed.barrier()
        state = m.load(mode=RecoveryMode.RECOVERY_VERIFIED)
        rep = m.last_restore
        return {
            "newest": newest,
            "loaded": rep.step,
            "walked": rep.walked_back_from,
            "same": _same(state, _state(rank, rep.step)),
            "sources": rep.sources,
        }


def test_a_corrupt_newest_verified_step_walks_back_to_an_older_verified_one(tmp_path) -> None:
    out = run_distributed(_verified_walk_back, 2, args=(str(tmp_path),), timeout_s=150)
    _assert_all_walked_back_to_10_from_own_disk(out)


def _damaged_peer_file(rank: int, world: int, tmp: str) -> dict:
    # One folder per rank, as on separate nodes: rank 0's folder holds rank 1's replica.
    # verify_integrity stores a CRC per chunk; without it a rotten byte goes unnoticed.
    cfg = _cfg(str(Path(tmp) / f"node-{rank}"), disk_flush_interval=10, verify_integrity=True)
    with InMemoryCheckpointManager(cfg) as m:
        _persisted_then_restarted(m, rank)
        store = m.store()
        if rank == 1:  # rank 1 lost its newest file: step 20 must come from rank 0's disk
            store.path_for(1, 20).unlink()
        else:  # ... where one data byte of the replica rotted (its header still validates)
            path = store.path_for(1, 20)
            data = bytearray(path.read_bytes())
            data[-3] ^= 0x10
            path.write_bytes(bytes(data))
        torch.distributed.barrier()
        return _outcome(m, rank, m.find_latest())


def test_a_rotten_byte_in_a_peers_replica_is_caught_by_its_owner_and_everyone_walks_back(
    tmp_path,
) -> None:
    out = run_distributed(_damaged_peer_file, 2, args=(str(tmp_path),), timeout_s=150)
    _assert_all_walked_back_to_10_from_own_disk(out)


def _verified(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp, disk_flush_interval=10)) as m:
        m.save(_state(rank, 10), 10)
        m.maybe_wait()
        none_yet = m.find_latest(RecoveryMode.RECOVERY_VERIFIED)
        try:
            m.load(mode=RecoveryMode.RECOVERY_VERIFIED)
            closed = None
        except NoConsistentStep as exc:
            closed = str(exc)
        m.trust.mark_verified(10)
        for step in (20, 30):
            m.save(_state(rank, step), step)
            m.maybe_wait()
        latest = m.find_latest()
        verified = m.find_latest(RecoveryMode.RECOVERY_VERIFIED)
        state = m.load(mode=RecoveryMode.RECOVERY_VERIFIED)
        return {
            "none_yet": none_yet,
            "closed": closed,
            "latest": latest,
            "verified": verified,
            "same": _same(state, _state(rank, 10)),
            "loaded": m.last_restore.step,
        }


def test_verified_mode_picks_the_verified_step_and_fails_closed_without_one(tmp_path) -> None:
    out = run_distributed(_verified, 2, args=(str(tmp_path),), timeout_s=150)
    for o in out:
        assert o["none_yet"] is None
        assert o["closed"] is not None and "load_fallback" in o["closed"]
        assert o["latest"] == 30
        assert o["verified"] == 10 and o["loaded"] == 10 and o["same"]


def _fallback(rank: int, world: int, tmp: str) -> dict:
    durable = {"model": {"w": torch.full((3,), float(rank))}}
    cfg = _cfg(tmp, replication_timeout_s=2)  # rank 1 never joins step 5's exchange
    with InMemoryCheckpointManager(cfg, load_fallback=lambda: durable) as m:
        if rank == 0:  # only part of the job has a capture: nothing is common
            m.save(_state(rank, 5), 5)
            m.maybe_wait()
        state = m.load()
        return {
            "same": _same(state, durable),
            "sources": m.last_restore.sources,
            "step": m.last_restore.step,
        }


def test_without_a_common_step_the_framework_fallback_is_used(tmp_path) -> None:
    out = run_distributed(_fallback, 2, args=(str(tmp_path),), timeout_s=120)
    for o in out:
        assert o["same"] and o["step"] is None
        assert o["sources"] == ["fallback", "fallback"]


def test_explicit_step_not_common_is_refused(tmp_path) -> None:
    with InMemoryCheckpointManager(_cfg(str(Path(tmp_path)))) as m:
        m.save(_state(0, 3), 3)
        m.maybe_wait()
        with pytest.raises(NoConsistentStep, match="step 4 is not available"):
            m.load(4)
        assert _same(m.load(3), _state(0, 3))


def _shared_disk_flush(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp)) as m:
        m.save(_state(rank, 10), 10)
        m.maybe_wait()
        m.wait_persisted()  # replication of step 10 finished (nothing is flushed periodically)
        if rank == 1:  # rank 1 persists first: its own shard and its replica of rank 0
            m.flush_newest()
        torch.distributed.barrier()
        if rank == 0:  # rank 1's shard already exists on this (shared) disk
            m.flush_newest()
        torch.distributed.barrier()
        written = m.flush_stats.written
        m.drop_memory()
        state = m.load()
        return {
            "written": written,
            "same": _same(state, _state(rank, 10)),
            "sources": m.last_restore.sources,
        }


def test_on_one_node_a_holder_does_not_rewrite_the_owners_shard(tmp_path) -> None:
    out = run_distributed(_shared_disk_flush, 2, args=(str(tmp_path),), timeout_s=120)
    assert out[1]["written"] == 2  # own shard + rank 0's (not yet on disk)
    assert out[0]["written"] == 1  # own shard only: rank 1's was already published
    for o in out:
        assert o["same"] and o["sources"] == ["own disk", "own disk"]


def _shard_state(shard: int, step: int) -> dict:
    g = torch.Generator().manual_seed(shard * 1000 + step)
    return {"model": {"w": torch.randn(256, generator=g)}, "step": step}


def _hsdp_replica(rank: int, world: int, tmp: str) -> dict:
    shard = rank % 2  # a 2 x 2 mesh, replicate-major: ranks r and r + 2 hold the same shard
    cfg = _cfg(tmp, replication_chunk_size=4096)
    m = InMemoryCheckpointManager(cfg, hsdp_replicated=True, replica_ranks=[shard, shard + 2])
    with m:
        assert "peer_current" not in m.slots()  # natural replicas: two own slots, no transfer
        for step in (10, 20):
            m.save(_shard_state(shard, step), step)
            m.maybe_wait()
        assert m.replication_stats is None
        if rank == 2:
            m.drop_memory()  # its node was lost: its memory is gone
        step = m.find_latest()
        state = m.load(step)
        rep = m.last_restore
        return {"step": step, "same": _same(state, _shard_state(shard, step)), "rep": rep.sources}


def test_hsdp_rank_without_memory_recovers_its_shard_from_a_replica_rank(tmp_path) -> None:
    out = run_distributed(_hsdp_replica, 4, args=(str(tmp_path),), timeout_s=150)
    for o in out:
        assert o["step"] == 20 and o["same"]
        assert o["rep"] == ["own memory", "own memory", "peer memory", "own memory"]


def test_hsdp_replica_ranks_must_be_an_evenly_spaced_replicate_dimension(tmp_path) -> None:
    with pytest.raises(RankFailures, match="must be evenly spaced"):
        run_distributed(_bad_replicas, 4, args=(str(tmp_path),), timeout_s=60)


def _bad_replicas(rank: int, world: int, tmp: str) -> None:
    InMemoryCheckpointManager(_cfg(tmp), hsdp_replicated=True, replica_ranks=[0, 1, 3])


def _two_rank_run(rank: int, world: int, tmp: str) -> None:
    m = InMemoryCheckpointManager(_cfg(tmp, disk_flush_interval=10, memory_folder=None))
    m.save(_state(rank, 10), 10)
    m.maybe_wait()
    m.wait_persisted()
    m.close(finished=False)


def test_a_restart_on_another_world_size_says_why_it_recovers_nothing(tmp_path, caplog) -> None:
    import logging

    run_distributed(_two_rank_run, 2, args=(str(tmp_path),), timeout_s=120)
    with caplog.at_level(logging.WARNING):
        m = InMemoryCheckpointManager(_cfg(str(tmp_path), memory_folder=None))
        assert m.find_latest() is None  # a 1-rank job cannot load 2-rank shards
        m.close(finished=False)
    assert "for another topology" in caplog.text and "resharding is not supported" in caplog.text

"""Recovery under damaged state on real ranks: every rank decides alike, the good copy of the
same step is tried before walking back, and an exit flush leaves a step in common."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.faults.disk import edit_document, flip_data_byte
from lm_resiliency.testing import run_distributed


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(512, generator=g), "step": step, "data": {"offset": step}}


def _cfg(tmp: str, rank: int, **kw) -> InMemoryCkptConfig:
    base = {
        "run_id": "hostile",
        "disk_folder": f"{tmp}/node-{rank}",  # one node per rank: replicas sit elsewhere
        "interval": 2,
        "disk_flush_interval": 2,
        "memory_folder": None,  # disk only: restarts below read files
        "verify_integrity": True,
        "replication_chunk_size": 4096,
        "signal_flush": False,
    }
    return InMemoryCkptConfig(**{**base, **kw})


def _train(rank: int, world: int, tmp: str) -> None:
    with InMemoryCheckpointManager(_cfg(tmp, rank)) as m:
        for step in (2, 4, 6, 8):
            m.save(_state(rank, step), step)
            m.maybe_wait()
        m.wait_persisted()
        dist.barrier()
        m.close(finished=False)


def _shard(tmp: str, node: int, owner: int, step: int) -> Path:
    (path,) = Path(tmp, f"node-{node}").glob(f"run-*/topo-*/step-{step}/rank-{owner}.safetensors")
    return path


def _schema_breaking(doc: dict) -> None:
    # A well-formed JSON document with a valid document CRC whose state fails the schema.
    doc["state"] = {"schema": "lm_resiliency.state/1", "tensor_count": 1, "root": {"k": "nope"}}


def _recover(rank: int, world: int, tmp: str, damage: str) -> dict:
    if rank == 0 and damage:
        targets = {"own": [0], "both": [0, 1]}[damage.split(":", 1)[0]]
        for node in targets:
            path = _shard(tmp, node, 0, 8)
            if damage.endswith(":schema"):
                edit_document(path, _schema_breaking, fix_crc=True)
            else:
                flip_data_byte(path)
    dist.barrier()
    with InMemoryCheckpointManager(_cfg(tmp, rank)) as m:
        step = m.find_latest()
        state = m.load(step)
        rep = m.last_restore
        out = {
            "listed": step,
            "step": rep.step,
            "same": torch.equal(state["w"], _state(rank, rep.step)["w"]),
            "sources": rep.sources,
            "walked_back_from": rep.walked_back_from,
            "problems": rep.problems,
        }
        m.close(finished=False)
        return out


def _run(tmp_path: Path, damage: str) -> list[dict]:
    run_distributed(_train, 2, args=(str(tmp_path),), ranks_per_node=1, timeout_s=120)
    return run_distributed(
        _recover, 2, args=(str(tmp_path), damage), ranks_per_node=1, timeout_s=120
    )


def test_a_schema_breaking_document_with_a_valid_crc_walks_every_rank_back(tmp_path) -> None:
    out = _run(tmp_path, "both:schema")  # rank 0's step 8 is bad on both nodes
    for o in out:
        assert (o["listed"], o["step"], o["walked_back_from"]) == (8, 6, [8])
        assert o["same"]
        assert o["sources"] == ["own disk", "own disk"]
    problems = " ".join(out[0]["problems"])
    assert "rank 0 own disk" in problems and "StateSchemaError" in problems
    assert out[0]["problems"] == out[1]["problems"]  # every rank knows the same story


def test_a_rank_whose_own_copy_fails_uses_its_peers_copy_of_the_same_step(tmp_path) -> None:
    out = _run(tmp_path, "own:data")  # only rank 0's own copy of step 8 is damaged
    for o in out:
        assert (o["step"], o["walked_back_from"]) == (8, [])
        assert o["same"]
        assert o["sources"] == ["peer disk", "own disk"]
    assert "checksum_mismatch" in " ".join(out[0]["problems"])


def _fuzzed(rank: int, world: int, tmp: str, seed: int) -> list[tuple[int, bool]]:
    rng = random.Random(seed)
    results = []
    for _ in range(6):
        if rank == 0:  # damage random bytes of rank 0's newest shard on both nodes
            for node in (0, 1):
                path = _shard(tmp, node, 0, 8)
                raw = bytearray(path.read_bytes())
                for _ in range(rng.randint(1, 4)):
                    i = rng.randrange(len(raw))
                    raw[i] ^= 1 << rng.randrange(8)
                path.write_bytes(bytes(raw))
        dist.barrier()
        with InMemoryCheckpointManager(_cfg(tmp, rank)) as m:
            state = m.load(m.find_latest())
            step = m.last_restore.step
            results.append((step, torch.equal(state["w"], _state(rank, step)["w"])))
            m.close(finished=False)
        dist.barrier()
    return results


def test_random_damage_is_decided_alike_on_every_rank(tmp_path) -> None:
    run_distributed(_train, 2, args=(str(tmp_path),), ranks_per_node=1, timeout_s=120)
    out = run_distributed(_fuzzed, 2, args=(str(tmp_path), 1234), ranks_per_node=1, timeout_s=240)
    assert [s for s, _ in out[0]] == [s for s, _ in out[1]]  # the same step on both ranks
    for per_rank in out:
        for step, same in per_rank:
            assert step in (6, 8) and same  # the original state, or an older intact one


def _exit_flush(rank: int, world: int, tmp: str) -> dict:
    cfg = _cfg(tmp, rank, disk_flush_interval=0, replication_timeout_s=2.0, memory_folder=None)
    m = InMemoryCheckpointManager(cfg)
    for step in (10, 20):
        m.save(_state(rank, step), step)
        m.maybe_wait()
    m.wait_persisted()
    dist.barrier()
    written: list[int] = []
    if rank == 0:
        m.save(_state(0, 25), 25)  # the peer never captures 25: no replica of it comes back
        m.maybe_wait()
        m.wait_persisted()
        written = m.flush_newest()  # what a SIGTERM right after save() persists
    dist.barrier()
    m.close(finished=False)
    return {"written": written}


def _after_exit(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp, rank)) as m:
        step = m.find_latest()
        state = m.load(step)
        out = {"step": step, "same": torch.equal(state["w"], _state(rank, step)["w"])}
        out["sources"] = m.last_restore.sources
        m.close(finished=False)
        return out


def test_an_exit_flush_persists_a_consistent_set(tmp_path) -> None:
    first = run_distributed(_exit_flush, 2, args=(str(tmp_path),), ranks_per_node=1, timeout_s=120)
    # own 20 and the peer's 20 (a common step), then the newer own 25
    assert first[0]["written"] == [20, 20, 25]
    out = run_distributed(_after_exit, 2, args=(str(tmp_path),), ranks_per_node=1, timeout_s=120)
    assert [o["step"] for o in out] == [20, 20] and all(o["same"] for o in out)
    assert out[1]["sources"] == ["own disk", "peer disk"]  # rank 1 never wrote a file

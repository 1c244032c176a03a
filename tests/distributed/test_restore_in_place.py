"""``load(into=...)`` on real Gloo ranks: every source restores straight into the live tensors.

The live tensors are a tree of the saved structure holding other values (a restarted
worker's freshly built model and optimizer). Tensors of several element sizes and
sizes that are no multiple of the 4 KiB replication chunk make chunks straddle tensor
boundaries, so the receiver's bounce buffers are used as well as direct receives.
Damaged bytes (a rotten byte in a held replica on /dev/shm, or in a shard file) land
in the live tensors first; the restore then refills them from the next source, or
fails closed on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, NoConsistentStep
from lm_resiliency.capture.slot import Slot
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory.slotfile import PAGE
from lm_resiliency.testing import run_distributed


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "model": {
            "w": torch.randn(300, 70, generator=g),
            "h": torch.randn(1001, generator=g).bfloat16(),
            "ids": torch.randint(0, 1 << 40, (333,), generator=g),
        },
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "lr": 0.1 * rank},
        "position": {"rank": rank, "step": step},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _tensors(tree: dict) -> list[torch.Tensor]:
    m, o = tree["model"], tree["optimizer"]["state"][0]
    return [m["w"], m["h"], m["ids"], o["step"]]


def _in_place(state: dict, live: dict) -> bool:
    """Whether the restored tree holds the live tensor objects themselves."""
    return all(a is b for a, b in zip(_tensors(state), _tensors(live), strict=True))


def _cfg(disk: str, **kw) -> InMemoryCkptConfig:
    base = {
        "replication_chunk_size": 4096,
        "disk_folder": disk,
        "disk_flush_interval": 10,
        "run_id": "in-place-test",
        "verify_integrity": True,
    }
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _capture(m: InMemoryCheckpointManager, rank: int, steps: tuple[int, ...]) -> None:
    for step in steps:
        m.save(_state(rank, step), step)
        m.maybe_wait()
    m.wait_persisted()


def _flip_slot_byte(slot: Slot, offset: int) -> None:
    """Flip one data byte of a slot's file on the memory filesystem (its arena, mapped)."""
    fd = os.open(slot.handle.file.where, os.O_RDWR)  # type: ignore[union-attr]
    try:
        byte = os.pread(fd, 1, PAGE + offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x20]), PAGE + offset)
    finally:
        os.close(fd)


def _flip_file_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # a data byte; the header still validates
    path.write_bytes(bytes(data))


def _result(m: InMemoryCheckpointManager, rank: int, state: dict, live: dict) -> dict:
    rep = m.last_restore
    assert rep is not None
    return {
        "step": rep.step,
        "sources": rep.sources,
        "problems": rep.problems,
        "in_place": rep.in_place,
        "holds_live": _in_place(state, live),
        "same": _same(state, _state(rank, rep.step)),
    }


def _every_source(rank: int, world: int, tmp: str) -> dict:
    """Own memory, then own disk (rank 0) and peer memory (rank 1), then peer disk (rank 1)."""
    out: dict = {}
    cfg = _cfg(str(Path(tmp) / f"node-{rank}"))
    with InMemoryCheckpointManager(cfg) as m:
        _capture(m, rank, (10,))
        live = _state(rank, 0)
        state = m.load(into=live)
        out["own memory"] = _result(m, rank, state, live)
        m.commit_restore()
        # Copied, not handed over: the slot is still committed and serves the step again.
        own = m.slots()["own_current"]
        out["kept"] = (own.complete, own.step)
        live = _state(rank, 0)
        state = m.load(into=live)
        out["own memory again"] = _result(m, rank, state, live)
        m.commit_restore()

        for role, slot in m.slots().items():
            if role.startswith("own"):
                slot.discard()  # own memory is gone on both; rank 0 still holds rank 1's replica
        if rank == 1:
            m.store().path_for(1, 10).unlink()
        dist.barrier()
        live = _state(rank, 0)
        state = m.load(into=live)
        out["mixed"] = _result(m, rank, state, live)
        m.commit_restore()

        if rank == 0:
            for role, slot in m.slots().items():
                if role.startswith("peer"):
                    slot.discard()  # rank 1's replica is now on rank 0's disk only
        dist.barrier()
        live = _state(rank, 0)
        state = m.load(into=live)
        out["peer disk"] = _result(m, rank, state, live)
        m.commit_restore()
    return out


def test_every_source_restores_into_the_live_tensors_bit_identical(tmp_path) -> None:
    out = run_distributed(_every_source, 2, args=(str(tmp_path),), timeout_s=200)
    for o in out:
        assert o["kept"] == (True, 10)
        for name in ("own memory", "own memory again", "mixed", "peer disk"):
            r = o[name]
            assert r["step"] == 10 and r["in_place"] and r["holds_live"] and r["same"], (name, r)
        assert o["own memory"]["sources"] == ["own memory", "own memory"]
        assert o["mixed"]["sources"] == ["own disk", "peer memory"]
        assert o["peer disk"]["sources"] == ["own disk", "peer disk"]


def _damaged_held_replica(rank: int, world: int, tmp: str, lose_disk: bool) -> dict:
    cfg = _cfg(str(Path(tmp) / f"node-{rank}"))
    with InMemoryCheckpointManager(cfg) as m:
        _capture(m, rank, (10,))
        if rank == 0:  # the replica of rank 1's step 10 rots on /dev/shm (and maybe its file)
            slot = m.slots()["peer_current"]
            assert (slot.step, slot.owner_rank, slot.complete) == (10, 1, True)
            _flip_slot_byte(slot, offset=5000)
            if lose_disk:
                _flip_file_byte(m.store().path_for(1, 10))
        else:  # rank 1's node lost its memory and its own shard
            m.drop_memory()
            m.store().path_for(1, 10).unlink()
        dist.barrier()
        live = _state(rank, 0)
        try:
            state = m.load(into=live)
        except NoConsistentStep as exc:
            return {"failed": str(exc)}
        return _result(m, rank, state, live)


def test_a_chunk_failing_its_crc_in_the_live_tensors_is_refilled_by_the_next_source(
    tmp_path,
) -> None:
    out = run_distributed(_damaged_held_replica, 2, args=(str(tmp_path), False), timeout_s=150)
    for o in out:
        assert o["step"] == 10 and o["sources"] == ["own memory", "peer disk"]
        refused = [p for p in o["problems"] if p.startswith("rank 1 peer memory")]
        assert len(refused) == 1 and "IntegrityError" in refused[0], o["problems"]
        # The damaged bytes were received into the live tensors, then overwritten.
        assert o["in_place"] and o["holds_live"] and o["same"]


def test_when_every_source_fails_its_crc_the_in_place_restore_fails_closed_everywhere(
    tmp_path,
) -> None:
    out = run_distributed(_damaged_held_replica, 2, args=(str(tmp_path), True), timeout_s=150)
    for o in out:
        assert "failed" in o, o
        assert "load(into=...) may hold bytes of the failed attempts" in o["failed"]
        assert "no load_fallback was given" in o["failed"]


def _own_disk_damaged(rank: int, world: int, tmp: str) -> dict:
    cfg = _cfg(str(Path(tmp) / f"node-{rank}"))
    with InMemoryCheckpointManager(cfg) as m:
        _capture(m, rank, (10,))
        m.drop_memory()
        if rank == 0:  # rank 0's own file rots: its replica on rank 1's disk serves it
            _flip_file_byte(m.store().path_for(0, 10))
        dist.barrier()
        live = _state(rank, 0)
        state = m.load(into=live)
        return _result(m, rank, state, live)


def test_an_own_file_failing_its_crc_in_the_live_tensors_is_refilled_from_the_peer(
    tmp_path,
) -> None:
    out = run_distributed(_own_disk_damaged, 2, args=(str(tmp_path),), timeout_s=150)
    for o in out:
        assert o["step"] == 10 and o["sources"] == ["peer disk", "own disk"]
        assert any("ShardIntegrityError" in p or "checksum" in p for p in o["problems"])
        assert o["in_place"] and o["holds_live"] and o["same"]


def _other_structure(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(str(Path(tmp) / f"node-{rank}"))) as m:
        _capture(m, rank, (10,))
        bad = _state(rank, 0)
        bad["model"]["w"] = torch.zeros(70, 300).t()  # the right shape, not contiguous
        try:
            m.load(into=bad)
        except ValueError as exc:
            refused = str(exc)
        other = _state(rank, 0)
        other["model"]["w"] = torch.zeros(70, 300)  # another layout: restored as usual
        state = m.load(into=other)
        return {
            "refused": refused,
            **_result(m, rank, state, other),
            "untouched": bool((other["model"]["w"] == 0).all()),
        }


def test_an_into_of_another_layout_is_not_used_and_a_non_contiguous_one_is_refused(
    tmp_path,
) -> None:
    out = run_distributed(_other_structure, 2, args=(str(tmp_path),), timeout_s=150)
    for o in out:
        assert "'model/w' is not contiguous" in o["refused"] and "into=None" in o["refused"]
        assert o["step"] == 10 and o["same"] and o["untouched"]
        assert not o["in_place"] and not o["holds_live"]


@pytest.mark.parametrize("size", [1, 4096, 5000])
def test_target_pieces_cover_the_arena_in_order(size: int) -> None:
    from lm_resiliency.capture.layout import Layout
    from lm_resiliency.capture.target import Target

    tensors = [torch.zeros(size, dtype=torch.float64), torch.zeros(3), torch.zeros(size).half()]
    names = ["a", "b", "c"]
    target = Target(Layout.from_tensors(tensors, names), tensors)
    data = torch.arange(target.total_bytes, dtype=torch.int64).to(torch.uint8)
    for off in range(0, target.total_bytes, 4096):
        target.write(off, data[off : off + 4096])
    flat = torch.cat([t.view(-1).view(torch.uint8) for t in (tensors[0], tensors[1], tensors[2])])
    assert torch.equal(flat, data)

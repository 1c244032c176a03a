"""Memory-slot checksums on real Gloo ranks: damaged bytes are refused where they arrive.

Every memory slot carries one CRC-32C per chunk of its arena, computed by the
capture worker after the copy (own slots) or verified on receipt (replicas).
Here a byte is flipped in the real slot file on the memory filesystem (the
arena is that file, mapped shared), once after the owner recorded its
checksums and before the slot was replicated, once in a holder's committed
replica before it is served home; neither damaged copy may ever be loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture.slot import Slot
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory.slotfile import PAGE
from lm_resiliency.testing import run_distributed


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "lr": 0.1 * rank},
        "position": {"rank": rank, "step": step},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _slot_path(slot: Slot) -> Path:
    """The slot's file on the memory filesystem (its arena is this file, mapped shared)."""
    where = Path(slot.handle.file.where)  # type: ignore[union-attr]
    assert where.is_file() and where.suffix == ".slot", where
    return where


def _flip_byte(path: Path, offset: int) -> None:
    """Flip one data byte of a slot file through the filesystem, as a memory fault would."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, PAGE + offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x20]), PAGE + offset)
    finally:
        os.close(fd)


def _cfg(disk: str, **kw) -> InMemoryCkptConfig:
    base = {
        "replication_chunk_size": 4096,
        "disk_folder": disk,
        "disk_flush_interval": 0,
        "run_id": "slot-crc-test",
    }
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _capture(m: InMemoryCheckpointManager, rank: int, step: int) -> None:
    m.save(_state(rank, step), step)
    m.maybe_wait()
    m.wait_persisted()


def _damaged_before_sending(rank: int, world: int, tmp: str) -> dict:
    with InMemoryCheckpointManager(_cfg(tmp)) as m:
        _capture(m, rank, 10)
        if rank == 0:
            # Fault point: after the worker sealed step 20's slot (its CRCs are in the
            # record) and before the exchange sends it, one byte of it flips.
            engine = m._engine
            replicate: Callable[[Slot], None] = engine.after_capture  # type: ignore[assignment]

            def corrupt_then_replicate(slot: Slot) -> None:
                if slot.step == 20:
                    assert slot.crcs is not None  # sealed: the owner's checksums are recorded
                    _flip_byte(_slot_path(slot), offset=12345)
                replicate(slot)

            engine.after_capture = corrupt_then_replicate
        dist.barrier()
        _capture(m, rank, 20)
        stats = m.replication_stats
        assert stats is not None
        after_20 = {k: (s.step, s.complete) for k, s in m.slots().items()}
        failures, error = stats.failures, stats.last_error
        dist.barrier()
        _capture(m, rank, 30)  # the next cycle replicates again
        peer = m.slots()["peer_current"]
        return {
            "after_20": after_20,
            "failures": failures,
            "error": error,
            "later": (peer.step, m.slots()["peer_previous"].step),
        }


def test_a_replica_damaged_after_its_checksums_is_refused_and_the_previous_pair_kept(
    tmp_path,
) -> None:
    out = run_distributed(_damaged_before_sending, 2, args=(str(tmp_path),), timeout_s=150)
    holder, owner = out[1], out[0]  # rank 1 holds rank 0's replica
    assert holder["after_20"]["peer_current"] == (None, False)  # step 20's replica refused
    assert holder["after_20"]["peer_previous"] == (10, True)  # the previous one stays
    assert holder["failures"] == 1
    assert "step 20" in holder["error"] and "rank 0" in holder["error"]
    assert "CRC-32C" in holder["error"] and "refused" in holder["error"]
    assert owner["after_20"]["peer_current"] == (20, True)  # the other direction was intact
    assert owner["failures"] == 0
    assert holder["later"] == (30, 10)  # healed; the refused step never became a replica
    assert owner["later"] == (30, 20)


def _damaged_while_held(rank: int, world: int, tmp: str) -> dict:
    # One disk folder per rank, as on separate nodes: rank 0's holds rank 1's replica too.
    cfg = _cfg(str(Path(tmp) / f"node-{rank}"), disk_flush_interval=10)
    with InMemoryCheckpointManager(cfg) as m:
        for step in (10, 20):
            _capture(m, rank, step)
        held: str | None = None
        if rank == 0:  # the replica of rank 1's step 20, committed on /dev/shm, rots
            slot = m.slots()["peer_current"]
            assert (slot.step, slot.owner_rank, slot.complete) == (20, 1, True)
            path = _slot_path(slot)
            _flip_byte(path, offset=777)
            held = str(path)
        else:  # rank 1's node lost its memory and its own shard of step 20
            m.drop_memory()
            m.store().path_for(1, 20).unlink()
        dist.barrier()
        state = m.load()
        rep = m.last_restore
        return {
            "held": held,
            "step": rep.step,
            "walked": rep.walked_back_from,
            "sources": rep.sources,
            "problems": rep.problems,
            "same": _same(state, _state(rank, rep.step)),
        }


def test_a_held_replica_damaged_in_memory_is_refused_by_its_owner_who_uses_the_next_source(
    tmp_path, _isolated_memory_folder: Path
) -> None:
    out = run_distributed(_damaged_while_held, 2, args=(str(tmp_path),), timeout_s=150)
    assert Path(out[0]["held"]).is_relative_to(_isolated_memory_folder)  # the real slot file
    for o in out:
        assert o["step"] == 20 and o["walked"] == []  # the same step, from the next source
        assert o["same"]  # bit-identical to the captured state: the damaged bytes never loaded
        assert o["sources"] == ["own memory", "peer disk"]
        refused = [p for p in o["problems"] if p.startswith("rank 1 peer memory")]
        assert len(refused) == 1 and "IntegrityError" in refused[0], o["problems"]

"""Recovery: restore a 1 GiB state from each GEMINI source vs its physical limit and vs DCP.

Two ranks (``run_distributed``, one simulated node each, each with its own
node-local folder, ``verify_integrity=True``) capture the same-shaped state,
replicate it and persist own state and replica before every repetition. Rank
0's sources are then forced one by one and rank 0 times ``manager.load(step)``
(both ranks call it; it is collective; rank 1 restores from its own memory, as a
healthy node would, so it does not compete for the disk):

* own memory  - as captured;
* own disk    - rank 0 ``drop_memory()``;
* peer memory - rank 0 also deletes its own file; rank 1 holds the replica in memory;
* peer disk   - rank 1 also frees its peer slots; it streams the replica file.

Physical limits measured in the same run on the same bytes: ``memcpy`` into a
pre-faulted buffer (own memory), a raw Gloo ``isend``/``irecv`` of 16 MiB chunks,
all posted at once (peer memory), a raw ``preadv`` (64 MiB calls, sequential
readahead hint) of a file of the same size into a pre-faulted buffer (own
disk), and the slower of raw read and raw Gloo (peer disk: a pipelined
read-and-send could reach it). A restore has to fill
memory it just allocated; the same limits into freshly allocated memory are
printed for reference (ratios use the pre-faulted, stricter ones). The incumbent:
``torch.distributed.checkpoint`` ``save``/``load`` of the same state tree
(``no_dist=True``), loading in place. Files are evicted from the page cache
(``posix_fadvise(DONTNEED)``) before every timed read, ours, raw and DCP alike.

Restart from memory in a *new process*: one process captures the state into
memory slots on /dev/shm (and persists it) and exits without closing, as a
crashed worker does; a second, new process builds a manager (which re-attaches
to the slot files and validates them: identity, layout, state word, record
CRC), calls ``find_latest()`` and ``load()`` (the slot's CRC-32C per chunk is
checked against its record, then the mapping is handed over, no copy; the
check's seconds are reported on their own, with their GB/s and their share of
the restore). The same new-process restore from own disk (page cache evicted), a raw
read of a file of the same size and DCP ``load`` are measured in the same run.

Also runs the demo's faulty torchrun job once (4 workers) and reports its
end-to-end recovery time in phases (detection, restart, startup, agreement, load).

Run: ``python benchmarks/recovery.py`` (``--size-mib 256`` for a quick look,
``--skip-demo``, ``--only-new-process``, ``--skip-new-process``; ``--stat median``: ratios of
medians instead of minimums). Needs ~6x the size in free memory per
rank. Prints a table and one JSON line. Targets: each of our paths >= 70 % of
its limit; from memory >= 10x faster than DCP load; a new process restoring from
memory >= 10x faster than from own disk and >= 20x faster than DCP load, with
attach + validate <= 50 ms/GiB (without the slot CRC check, reported apart).

Slot checksums on the replication path: every received replica is checked
against the owner's CRC-32C per chunk on the holder's capture worker; its
seconds, GB/s and ratio to the exchange it protects are printed, measured on the
replication cycles of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.capture import allocate_arena
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed

MIB = 1024 * 1024
CHUNK = 16 * MIB
SOURCES = ("own memory", "own disk", "peer memory", "peer disk")


def _state(nbytes: int, seed: int) -> dict[str, Any]:
    """A model/optimizer-shaped tree: float32 matrices, a bf16 block, RNG state, a step."""
    g = torch.Generator().manual_seed(seed)
    bf16_bytes = nbytes // 16
    n_mats = 15
    per = (nbytes - bf16_bytes) // n_mats // 4
    model = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n_mats)}
    return {
        "model": model,
        "optimizer": {"half": torch.randn(bf16_bytes // 2, generator=g).bfloat16()},
        "rng": torch.get_rng_state(),
        "step": 1,
    }


def _evict(*paths: Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _raw_read(path: Path, into: torch.Tensor) -> None:
    view = memoryview(into.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # the kernel's best readahead
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done : done + 64 * MIB]], done)
            if got <= 0:
                raise OSError(f"{path}: short read at {done}")
            done += got
    finally:
        os.close(fd)


def _raw_gloo(group: Any, rank: int, buf: torch.Tensor) -> None:
    works = []
    for off in range(0, buf.numel(), CHUNK):
        piece = buf[off : off + CHUNK]
        if rank == 1:
            works.append(dist.isend(piece, group_dst=0, group=group))
        else:
            works.append(dist.irecv(piece, group_src=1, group=group))
    for w in works:
        w.wait()


def _limits(rank: int, nbytes: int, repeats: int, root: Path) -> dict[str, list[float]]:
    """memcpy, raw Gloo and raw read of ``nbytes`` (rank 0's times)."""
    group = dist.new_group(backend="gloo")
    src = allocate_arena(nbytes, pin=False)
    src.random_(0, 255)
    dst = allocate_arena(nbytes, pin=False)
    path = root / f"raw-{rank}.bin"
    if rank == 0:
        with open(path, "wb") as f:
            f.write(memoryview(src.numpy()))
            f.flush()
            os.fsync(f.fileno())
    out: dict[str, list[float]] = {
        "memcpy": [],
        "memcpy_fresh": [],
        "gloo": [],
        "gloo_fresh": [],
        "read": [],
        "read_fresh": [],
    }
    _raw_gloo(group, rank, dst[: 4 * MIB])  # warm-up: the first message pays the connection

    def fresh() -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    for _ in range(repeats):
        out["memcpy"].append(_timed(lambda: dst.copy_(src)))
        out["memcpy_fresh"].append(_timed(src.clone))
        out["gloo"].append(_timed(lambda: _raw_gloo(group, rank, dst if rank == 0 else src)))
        out["gloo_fresh"].append(
            _timed(lambda: _raw_gloo(group, rank, fresh() if rank == 0 else src))
        )
        for name, into in (("read", lambda: dst), ("read_fresh", fresh)):
            if rank == 0:
                _evict(path)
            out[name].append(_timed(lambda i=into: _raw_read(path, i()) if rank == 0 else None))
    if rank == 0:
        if not torch.equal(dst, src):
            raise AssertionError("raw read returned other bytes")
        path.unlink()
    return out


def _ours(rank: int, state: dict[str, Any], repeats: int, root: Path) -> dict[str, Any]:
    config = InMemoryCkptConfig(
        interval=1,
        disk_flush_interval=1,
        disk_folder=root / f"node-{rank}",
        run_id="bench-recovery",
        replication_chunk_size=CHUNK,
        replication_timeout_s=600.0,
        signal_flush=False,
        pin_memory=False,
        verify_integrity=True,
    )
    manager = InMemoryCheckpointManager(config)
    store = manager.store()
    step = 0
    times: dict[str, list[float]] = {}
    sources: dict[str, list[str]] = {}
    phases: dict[str, list[dict[str, float]]] = {}
    # A restarted worker's model and optimizer, built (and so mapped) before it recovers.
    live = _like(state)
    runs = [(source, into) for source in SOURCES for into in (False, True)]
    for source, into in runs:
        name = f"{source} in place" if into else source
        times[name] = []
        for rep in range(repeats):
            # Every repetition starts from a fresh capture (not timed): both ranks hold
            # their own state and the peer's replica in memory and on disk. Then only
            # rank 0 loses what the source under test requires; rank 1 restores from
            # its own memory (a hand-over, no bytes), as on a separate healthy node,
            # so rank 0's restore has the disk and the cores the limits had.
            step += 1
            manager.save(state, step)
            manager.maybe_wait()
            manager.wait_persisted()
            own_file, held_file = store.path_for(rank, step), store.path_for(1 - rank, step)
            if rank == 0 and source != "own memory":
                manager.drop_memory()
                if source != "own disk":
                    own_file.unlink()
            if rank == 1 and source == "peer disk":
                for role, slot in manager.slots().items():
                    if role.startswith("peer"):
                        slot.free()  # the replica survives on rank 1's disk only
            for f in (own_file, held_file):
                if f.exists():
                    _evict(f)
            dist.barrier()
            t0 = time.perf_counter()
            # Rank 1 hands its own slot over in both variants (no copy), so that rank 0's
            # restore never waits for rank 1's work.
            mine = into and rank == 0
            loaded = manager.load(step, into=live if mine else None)
            times[name].append(time.perf_counter() - t0)
            report = manager.last_restore
            assert report is not None
            sources[name] = report.sources
            phases.setdefault(name, []).append(report.phases_s)
            if report.in_place != mine:
                raise AssertionError(f"{name}: in_place={report.in_place}")
            if rep == 0:
                _check_equal(loaded, state, name)
            manager.commit_restore()
            del loaded
    repl = manager.replication_stats
    assert repl is not None
    replica = {"cycle_s": list(repl.seconds), "verify_s": list(repl.verify_s)}
    manager.close()
    return {
        "times": times,
        "sources": sources,
        "phases": phases,
        "bytes": _nbytes(state),
        "replica_crc": replica,
    }


def _like(state: dict[str, Any]) -> dict[str, Any]:
    """A tree of ``state``'s structure with other values, every page written (mapped)."""
    return {
        "model": {k: torch.full_like(v, 0.5) for k, v in state["model"].items()},
        "optimizer": {"half": torch.full_like(state["optimizer"]["half"], 0.25)},
        "rng": torch.zeros_like(state["rng"]),
        "step": 0,
    }


def _check_equal(loaded: dict[str, Any], state: dict[str, Any], source: str) -> None:
    pairs = [(loaded["model"][k], v) for k, v in state["model"].items()]
    pairs.append((loaded["optimizer"]["half"], state["optimizer"]["half"]))
    if not all(torch.equal(a, b) for a, b in pairs) or loaded["step"] != state["step"]:
        raise AssertionError(f"state restored from {source} differs from the captured one")


def _nbytes(state: dict[str, Any]) -> int:
    tensors = [*state["model"].values(), state["optimizer"]["half"], state["rng"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def _dcp(rank: int, state: dict[str, Any], repeats: int, root: Path) -> list[float]:
    folder = root / "dcp"
    times: list[float] = []
    # Tensors only: DCP would pickle the plain "step" value.
    tensors = {k: v for k, v in state.items() if k != "step"}
    if rank == 0:
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)

    def load() -> None:
        if rank == 0:
            dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)

    for _ in range(repeats):
        if rank == 0:
            _evict(*(p for p in folder.iterdir() if p.is_file()))
        times.append(_timed(load))
    return times


def _rank(rank: int, world: int, size_mib: int, repeats: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tmp = Path(root)
    limits = _limits(rank, size_mib * MIB, repeats, tmp)
    state = _state(size_mib * MIB, seed=rank)
    ours = _ours(rank, state, repeats, tmp)
    return {"limits": limits, "ours": ours, "dcp": _dcp(rank, state, repeats, tmp)}


def _demo_recovery(timeout_s: float) -> dict[str, Any] | None:
    from lm_resiliency.demo.events import read_run_events
    from lm_resiliency.demo.launch import DemoSpec, start_job
    from lm_resiliency.demo.timeline import summarize

    work = Path(tempfile.mkdtemp(prefix="lmr-bench-demo-"))
    try:
        spec = DemoSpec(steps=40, interval=5, flush_interval=20, fault_step=33, fault_rank=1)
        job = start_job(spec, work / "run", work / "disk", nproc=4, run_id=f"b-{uuid.uuid4().hex}")
        done = job.wait(timeout_s)
        rec = summarize(read_run_events(work / "run")).recovery
        if done.returncode != 0 or rec is None:
            print(f"demo job failed (exit {done.returncode}); no recovery timing")
            return None
        return {"total_s": rec.total_s, **{f"{k}_s": v for k, v in rec.phases_s.items()}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _child(mode: str, size_mib: int, root: str) -> None:
    """One new process of the restart benchmark; prints one JSON line."""
    torch.set_num_threads(1)
    into = mode.endswith("-into")  # load(into=the live tensors) instead of a copy after load
    mode = mode.removesuffix("-into")
    memory = None if mode == "disk" else str(Path(root) / "shm")
    config = InMemoryCkptConfig(
        interval=1,
        disk_flush_interval=1,
        disk_folder=str(Path(root) / "disk"),
        memory_folder=memory,
        run_id="bench-restart",
        signal_flush=False,
        pin_memory=False,
    )
    if mode == "capture":
        manager = InMemoryCheckpointManager(config)
        manager.save(_state(size_mib * MIB, seed=7), 1)
        manager.wait_persisted()
        manager.close(finished=False)  # an unfinished run: the slots stay, as after a crash
        print(json.dumps({"captured": True}))
        return
    for f in Path(root, "disk").rglob("*.safetensors"):
        _evict(f)
    # Where a restarted worker's model and optimizer live (built before it recovers):
    # applying the state copies into them, as load_state_dict does (and DCP load in place).
    live = _state(size_mib * MIB, seed=8)
    t0 = time.perf_counter()  # a restarted worker's manager: from here to a usable state
    manager = InMemoryCheckpointManager(config)
    t1 = time.perf_counter()
    step = manager.find_latest()
    t2 = time.perf_counter()
    loaded = manager.load(step, into=live if into else None)
    t3 = time.perf_counter()
    if not into:
        for k, v in live["model"].items():
            v.copy_(loaded["model"][k])
        live["optimizer"]["half"].copy_(loaded["optimizer"]["half"])
    t4 = time.perf_counter()
    report = manager.last_restore
    assert report is not None and report.in_place == into
    if step == 1:
        _check_equal(loaded, _state(size_mib * MIB, seed=7), f"a new process ({mode})")
    # The copy into the live tensors: after the load, or (in place) its decode phase.
    copy_s = report.phases_s["decode"] if into else t4 - t3
    crc_s = sum(manager.tier.verify_s) if manager.tier is not None else 0.0  # inside load_s
    manager.close(finished=False)
    # The limit of that copy in this process: memcpy between two pre-faulted buffers.
    nbytes = _nbytes(live) - live["rng"].numel()
    a, b = allocate_arena(nbytes, pin=False), allocate_arena(nbytes, pin=False)
    a.fill_(3)
    memcpy_s = min(_clock(lambda: b.copy_(a)) for _ in range(3))
    print(json.dumps({
        "construct_s": t1 - t0, "find_latest_s": t2 - t1, "load_s": t3 - t2,
        "restore_s": t3 - t0, "applied_s": t4 - t0, "sources": report.sources,
        "attach_crc_s": crc_s, "copy_s": copy_s, "memcpy_s": memcpy_s,
    }))  # fmt: skip


def _clock(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run_child(mode: str, size_mib: int, root: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--size-mib", str(size_mib), str(root)],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _new_process(size_mib: int, repeats: int) -> dict[str, Any]:
    """Restart from memory vs own disk vs raw read vs DCP load, each in a fresh process."""
    nbytes = size_mib * MIB
    root = Path(tempfile.mkdtemp(prefix="lmr-bench-restart-", dir="/dev/shm"))
    disk_root = Path(tempfile.mkdtemp(prefix="lmr-bench-restart-"))
    modes = ("memory", "memory-into", "disk", "disk-into")
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        (root / "disk").symlink_to(disk_root)  # files on the real disk, slots on tmpfs
        for _ in range(repeats):
            for mode in modes:
                _run_child("capture", size_mib, root)
                out[mode].append(_run_child(mode, size_mib, root))
                shutil.rmtree(root / "shm", ignore_errors=True)
                for child in disk_root.iterdir():
                    shutil.rmtree(child, ignore_errors=True)
        raw = []
        buf = allocate_arena(nbytes, pin=False)
        path = disk_root / "raw.bin"
        with open(path, "wb") as f:
            f.write(bytes(1 << 20) * size_mib)
            os.fsync(f.fileno())
        for _ in range(repeats):
            _evict(path)
            t0 = time.perf_counter()
            _raw_read(path, buf)
            raw.append(time.perf_counter() - t0)
        state = _state(nbytes, seed=7)
        tensors = {k: v for k, v in state.items() if k != "step"}
        folder = disk_root / "dcp"
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
        dcp_s = []
        for _ in range(repeats):
            _evict(*(p for p in folder.iterdir() if p.is_file()))
            t0 = time.perf_counter()
            dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
            dcp_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    return {"runs": out, "raw_read_s": raw, "dcp_load_s": dcp_s, "bytes": nbytes}


def _report_new_process(res: dict[str, Any], stat: str) -> dict[str, Any]:
    med = min if stat == "min" else statistics.median
    gib = res["bytes"] / (1 << 30)

    def of(mode: str) -> dict[str, float]:
        runs = res["runs"][mode]
        return {k: med(r[k] for r in runs) for k in runs[0] if k.endswith("_s")}

    mem, disk, mem_in, disk_in = of("memory"), of("disk"), of("memory-into"), of("disk-into")
    raw, dcp_s = med(res["raw_read_s"]), med(res["dcp_load_s"])
    attach_validate = mem["construct_s"] + mem["find_latest_s"]
    row = {
        "memory_restore_s": round(mem["restore_s"], 4),
        "attach_validate_ms_per_gib": round(1e3 * attach_validate / gib, 1),
        "hand_over_s": round(mem["load_s"], 4),
        "disk_restore_s": round(disk["restore_s"], 4),
        "raw_read_s": round(raw, 4),
        "dcp_load_s": round(dcp_s, 4),
        "disk_over_memory": round(disk["restore_s"] / mem["restore_s"], 1),
        "dcp_over_memory": round(dcp_s / mem["restore_s"], 1),
        "memory_applied_s": round(mem["applied_s"], 4),
        "disk_applied_s": round(disk["applied_s"], 4),
        "dcp_over_memory_applied": round(dcp_s / mem["applied_s"], 1),
        "attach_crc_s": round(mem["attach_crc_s"], 4),
        "attach_crc_gbps": round(_gbps(res["bytes"], mem["attach_crc_s"]), 2),
        "attach_crc_share_of_restore": round(mem["attach_crc_s"] / mem["restore_s"], 3),
        "sources": [res["runs"]["memory"][0]["sources"], res["runs"]["disk"][0]["sources"]],
        "memory_copy_s": round(mem["copy_s"], 4),
        "memory_copy_over_memcpy": round(mem["memcpy_s"] / mem["copy_s"], 3),
        "memory_in_place_copy_s": round(mem_in["copy_s"], 4),
        "memory_in_place_copy_over_memcpy": round(mem_in["memcpy_s"] / mem_in["copy_s"], 3),
        "memory_in_place_applied_s": round(mem_in["applied_s"], 4),
        "disk_in_place_applied_s": round(disk_in["applied_s"], 4),
        "disk_in_place_load_over_raw_read": round(raw / disk_in["load_s"], 3),
        "disk_load_over_raw_read": round(raw / disk["load_s"], 3),
    }
    print(
        f"new process restoring {res['bytes'] / MIB:.0f} MiB ({stat}; interpreter start excluded):"
    )
    print(
        f"  from memory slots: {mem['restore_s']:.3f} s = construct+attach+validate "
        f"{mem['construct_s']:.3f} + find_latest {mem['find_latest_s']:.3f} + hand-over "
        f"{mem['load_s']:.3f}  ({row['attach_validate_ms_per_gib']} ms/GiB attach+validate)"
    )
    print(
        f"  from own disk:     {disk['restore_s']:.3f} s   raw read {raw:.3f} s   DCP load "
        f"{dcp_s:.3f} s"
    )
    print(f"  of which the slot's CRC-32C check (inside the hand-over): "
          f"{mem['attach_crc_s']:.3f} s = {row['attach_crc_gbps']:.2f} GB/s, "
          f"{100 * row['attach_crc_share_of_restore']:.0f} % of the restore")  # fmt: skip
    print(f"  memory is {row['disk_over_memory']}x faster than own disk, "
          f"{row['dcp_over_memory']}x faster than DCP load")  # fmt: skip
    print(f"  restored and copied into the live model/optimizer tensors (as load_state_dict; "
          f"DCP loads in place): memory {mem['applied_s']:.3f} s, own disk "
          f"{disk['applied_s']:.3f} s; DCP load / memory = {row['dcp_over_memory_applied']}x "
          "(the copy maps the slot's pages on first touch)")  # fmt: skip
    print(f"  the copy alone: {mem['copy_s']:.3f} s = {row['memory_copy_over_memcpy']}x memcpy "
          f"({mem['memcpy_s']:.3f} s); load(into=live): {mem_in['copy_s']:.3f} s = "
          f"{row['memory_in_place_copy_over_memcpy']}x memcpy ({mem_in['memcpy_s']:.3f} s), "
          f"applied {mem_in['applied_s']:.3f} s")  # fmt: skip
    print(f"  own disk load: into fresh memory {disk['load_s']:.3f} s = "
          f"{row['disk_load_over_raw_read']}x raw read, load(into=live) {disk_in['load_s']:.3f} s"
          f" = {row['disk_in_place_load_over_raw_read']}x raw read, applied "
          f"{disk_in['applied_s']:.3f} s")  # fmt: skip
    return row


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _replica_crc(stats: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """The holder's CRC check of each received replica vs the exchange it protects."""
    med = statistics.median
    verify, cycle = stats["verify_s"], stats["cycle_s"]
    exchange = [c - v for c, v in zip(cycle, verify, strict=True)]
    v, x = med(verify), med(exchange)
    return {
        "cycles": len(verify),
        "verify_s": round(v, 4),
        "verify_gbps": round(_gbps(nbytes, v), 2),
        "exchange_s": round(x, 4),
        "exchange_gbps": round(_gbps(nbytes, x), 2),
        "verify_over_exchange": round(v / x, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--only-new-process", action="store_true")
    parser.add_argument("--stat", choices=("min", "median"), default="min")
    parser.add_argument("--skip-new-process", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("child_root", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.size_mib, args.child_root)
        return
    restart = (
        None
        if args.skip_new_process
        else _report_new_process(_new_process(args.size_mib, args.repeats), args.stat)
    )
    if args.only_new_process:
        print(json.dumps({"benchmark": "recovery-restart", **(restart or {})}))
        return
    root = Path(tempfile.mkdtemp(prefix="lmr-bench-recovery-"))
    try:
        per_rank = run_distributed(
            _rank,
            2,
            args=(args.size_mib, args.repeats, str(root)),
            ranks_per_node=1,
            timeout_s=3600,
            pg_timeout_s=900,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r0 = per_rank[0]
    # Minimums by default: the machine is shared, and noise only ever adds time.
    med = min if args.stat == "min" else statistics.median
    nbytes = int(r0["ours"]["bytes"])
    lim = {k: med(v) for k, v in r0["limits"].items()}
    limit_of = {
        "own memory": ("memcpy", lim["memcpy"]),
        "own disk": ("raw read", lim["read"]),
        "peer memory": ("raw Gloo", lim["gloo"]),
        "peer disk": ("max(read, Gloo)", max(lim["read"], lim["gloo"])),
    }
    dcp_s = med(r0["dcp"])
    print(
        f"restore {nbytes / MIB:.0f} MiB on rank 0 of 2 ({os.cpu_count()} CPUs), {args.stat} of "
        f"{args.repeats}, page cache evicted before each read; 'in place': load(into=live "
        "tensors), the others into fresh memory"
    )
    print(f"{'source':<21} {'ours s':>8} {'GB/s':>6} {'limit':>16} {'GB/s':>6} {'ours/limit':>10} "
          f"{'DCP/ours':>8}  sources")  # fmt: skip
    rows = []
    names = [(src, n) for src in SOURCES for n in (src, f"{src} in place")]
    for source, label in names:
        ours_s = med(r0["ours"]["times"][label])
        name, limit_s = limit_of[source]
        row = {
            "source": label,
            "ours_s": round(ours_s, 4),
            "ours_gbps": round(_gbps(nbytes, ours_s), 3),
            "limit": name,
            "limit_gbps": round(_gbps(nbytes, limit_s), 3),
            "ours_over_limit": round(limit_s / ours_s, 3),
            "dcp_over_ours": round(dcp_s / ours_s, 2),
            "sources": r0["ours"]["sources"][label],
        }
        rows.append(row)
        print(f"{label:<21} {ours_s:>8.3f} {row['ours_gbps']:>6.2f} {name:>16} "
              f"{row['limit_gbps']:>6.2f} {row['ours_over_limit']:>10.2f} "
              f"{row['dcp_over_ours']:>8.2f}  {','.join(row['sources'])}")  # fmt: skip
    for _, label in names:
        runs = r0["ours"]["phases"][label]
        parts = ", ".join(f"{k} {med([p[k] for p in runs]):.3f}" for k in runs[0] if k != "fetch")
        print(f"  {label:<21} phases ({args.stat} s): {parts}")
    print(f"DCP load (no_dist, in place): {dcp_s:.3f} s, {_gbps(nbytes, dcp_s):.2f} GB/s")
    replica = _replica_crc(r0["ours"]["replica_crc"], nbytes)
    print(f"received replica (rank 0, {replica['cycles']} cycles, median): CRC-32C check "
          f"{replica['verify_s']:.3f} s = {replica['verify_gbps']:.2f} GB/s on the capture "
          f"worker, {replica['verify_over_exchange']:.2f}x the exchange it protects "
          f"({replica['exchange_s']:.3f} s, {replica['exchange_gbps']:.2f} GB/s)")  # fmt: skip
    print("the same limits into freshly allocated memory (page faults included), GB/s: "
          f"memcpy {_gbps(nbytes, lim['memcpy_fresh']):.2f}, raw Gloo "
          f"{_gbps(nbytes, lim['gloo_fresh']):.2f}, raw read "
          f"{_gbps(nbytes, lim['read_fresh']):.2f}")  # fmt: skip
    demo = None if args.skip_demo else _demo_recovery(timeout_s=600)
    if demo is not None:
        parts = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in demo.items() if k != "total_s")
        print(f"demo (4 workers, torchrun, SIGKILL): recovery {demo['total_s']:.2f} s = {parts}")
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "bytes": nbytes,
                "rows": rows,
                "dcp_load_s": round(dcp_s, 4),
                "limits_s": {k: round(v, 4) for k, v in lim.items()},
                "demo_recovery_s": demo,
                "replica_crc": replica,
                "new_process": restart,
            }
        )
    )


if __name__ == "__main__":
    main()

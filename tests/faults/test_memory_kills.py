"""Real SIGKILLs while a slot is being written: a torn slot is never loaded.

* A process is killed while its capture copies into a memory slot (the slot's
  state word reads WRITING at that moment): a new process recovers the
  previous committed step, bit for bit, and the torn slot stays unused.
* A rank is killed while it receives its peer's replica: after the restart the
  peer, whose own memory is gone, is served the previous committed replica.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed

WORKER = Path(__file__).with_name("memory_worker.py")
_WRITING = 1


def _state_word(path: Path) -> tuple[int, int] | None:
    """(state, step) of a slot file, or None while it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(32)
    except OSError:
        return None
    if len(head) < 32:
        return None
    return struct.unpack("<I", head[12:16])[0], struct.unpack("<q", head[24:32])[0]


def _worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def test_a_kill_mid_copy_never_loads_the_torn_slot(_isolated_memory_folder: Path) -> None:
    proc = _worker("capture", "kill-mid-copy", "128")
    assert proc.stdout is not None
    committed = 0
    while committed < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "worker ended"
        committed = int(line.split()[1])
    slots = list(_isolated_memory_folder.glob("run-*/topo-*/rank-0/own-*.slot"))
    assert len(slots) == 2
    deadline = time.monotonic() + 60
    torn = None
    while torn is None and time.monotonic() < deadline:
        for s in slots:
            word = _state_word(s)
            if word is not None and word[0] == _WRITING:
                proc.send_signal(signal.SIGKILL)  # mid-copy: the state word says so
                torn = s
                break
    assert torn is not None, "never saw a capture in flight"
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert _state_word(torn)[0] == _WRITING  # the torn slot is still marked unfinished
    other = next(s for s in slots if s != torn)
    survivor_step = _state_word(other)[1]
    out, err = _worker("recover", "kill-mid-copy", "128").communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"step": survivor_step, "same": True, "sources": ["own memory"]}, err
    assert "not_committed" in err  # the torn slot was seen and ignored with its reason


def _big(rank: int, step: int) -> dict:
    return {"w": torch.full((8 << 20,), float(rank * 1000 + step)), "step": step}


def _cfg() -> InMemoryCkptConfig:
    return InMemoryCkptConfig(
        run_id="kill-mid-receive",
        disk_flush_interval=0,
        replication_chunk_size=1 << 20,
        replication_timeout_s=20,
        signal_flush=False,
    )


def _kill_while_receiving(rank: int, world: int, memory: str) -> dict | None:
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())  # test plumbing only
    m = InMemoryCheckpointManager(_cfg())
    for step in (10, 20):
        m.save(_big(rank, step), step)
        m.maybe_wait()
        m.wait_persisted()
    dist.barrier()
    seen: list[int] = []
    if rank == 0:  # kill rank 1 while its held slot receives step 30

        def watch() -> None:
            held = sorted(Path(memory).glob("run-*/topo-*/rank-1/held-*.slot"))
            while True:
                for h in held:
                    word = _state_word(h)
                    if word is not None and word[0] == _WRITING:
                        os.kill(pids[1], signal.SIGKILL)
                        seen.append(1)
                        return

        threading.Thread(target=watch, daemon=True).start()
    m.save(_big(rank, 30), 30)
    m.maybe_wait()
    m.wait_persisted()
    result = {"seen": bool(seen), "failures": m.replication_stats.failures}
    m.close(finished=False)
    return result


def _restart(rank: int, world: int) -> dict:
    with InMemoryCheckpointManager(_cfg()) as m:
        if rank == 0:
            m.drop_memory()  # rank 0 needs its peer's replica of its state
        step = m.find_latest()
        state = m.load(step)
        rep = m.last_restore
        out = {
            "step": step,
            "same": torch.equal(state["w"], _big(rank, step)["w"]),
            "sources": rep.sources,
            "problems": rep.problems,
        }
        m.close(finished=False)
        return out


def test_a_kill_mid_receive_serves_the_previous_committed_replica(
    _isolated_memory_folder: Path,
) -> None:
    first = run_distributed(
        _kill_while_receiving,
        2,
        args=(str(_isolated_memory_folder),),
        kill={1: "killed-by-its-peer"},  # rank 1 is expected to die
        timeout_s=180,
    )
    assert first[0]["seen"] and first[0]["failures"] >= 1
    held = sorted(_isolated_memory_folder.glob("run-*/topo-*/rank-1/held-*.slot"))
    assert sorted(w[0] for w in map(_state_word, held)) == [1, 2]  # one torn, one committed
    out = run_distributed(_restart, 2, timeout_s=180)
    # Rank 1's replica of step 30 was torn: rank 0 can only get step 20, from rank 1's memory.
    assert [o["step"] for o in out] == [20, 20]
    assert all(o["same"] for o in out)
    assert out[0]["sources"] == ["peer memory", "own memory"]

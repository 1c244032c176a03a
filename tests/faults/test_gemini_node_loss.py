"""Node loss: a simulated node, its memory and its disk vanish; its ranks recover from the
replicas the surviving node holds in memory.

Two simulated nodes (network namespaces, ``lm_resiliency.testing.netns``), each a
torchrun agent with 2 demo workers, its own memory folder (the slots' tmpfs
files) and its own node-local disk folder: node A holds ranks 0-1, node B ranks
2-3. With ``replication_jump=-1`` the jump is the node width (2), so rank 2's
replica lives on rank 0 and rank 3's on rank 1.

After step 12 (captures at 5 and 10) every worker idles. The test then SIGKILLs
every process of node B, deletes node B's memory and disk folders and node A's
disk folder too, and starts a replacement node B with empty folders. Node A's
workers see their peers vanish and exit on the error (their memory slots stay
on node A); torchrun restarts them when the replacement joins, and all four
ranks must agree on step 10: ranks 0-1 from their own memory (re-attached by the
restarted workers), ranks 2-3 from the replicas node A holds in memory, shipped
over the replication channel. The final state must be bit-identical to a
fault-free 4-rank run of the same seed.

Skips with the reason where namespaces cannot be created (not root, no ``ip``);
CI here runs as root.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from lm_resiliency.demo.events import read_run_events
from lm_resiliency.demo.launch import DemoSpec, compare_final, start_job
from lm_resiliency.demo.timeline import summarize
from lm_resiliency.demo.worker import HOLD_MARKER
from lm_resiliency.testing.netns import NetnsNode, netns_available, two_node_namespaces
from lm_resiliency.testing.torchrun import TorchrunJob

_available, _why = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _available, reason=_why)]

_JOB_TIMEOUT_S = 300.0
_RDZV_PORT = 29400  # on node A's private address: nothing else can hold it
_SPEC = DemoSpec(steps=20, interval=5, flush_interval=5, hold_step=12, pg_timeout_s=60.0)
MEMORY_ENV = "LM_RESILIENCY_MEMORY_FOLDER"


def _start_node(
    node: NetnsNode,
    host: NetnsNode,
    run_dir: Path,
    disk: Path,
    memory: Path,
    run_id: str,
    logs: Path,
) -> TorchrunJob:
    return start_job(
        _SPEC,
        run_dir,
        disk,
        nproc=2,
        run_id=run_id,
        max_restarts=1,
        # A replacement node can join only when the agents do not share their
        # store (docs/launching.md); rank 0 then hosts one per worker group.
        env={**node.env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", MEMORY_ENV: str(memory)},
        nnodes="2",
        rdzv_endpoint=f"{host.address}:{_RDZV_PORT}",
        local_addr=node.address,
        command_prefix=node.command_prefix,
        extra_args=[
            f"--rdzv-conf=is_host={int(node is host)},keep_alive_interval=1,"
            "keep_alive_max_attempt=2"
        ],
        workdir=logs,
    )


def _wait_holding(run_dir: Path, jobs: list[TorchrunJob], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        holding = {r["rank"] for r in read_run_events(run_dir) if r["event"] == "holding"}
        if holding == {0, 1, 2, 3}:
            return
        if time.monotonic() > deadline or any(j.poll() is not None for j in jobs):
            pytest.fail(f"only ranks {sorted(holding)} reached the hold step:\n" + "\n".join(
                j.stdout_so_far() for j in jobs))  # fmt: skip
        time.sleep(0.1)


def test_lost_node_recovers_from_replicas_in_the_surviving_nodes_memory(
    tmp_path: Path, _isolated_memory_folder: Path
) -> None:
    run_dir = tmp_path / "run"
    disk_a, disk_b = tmp_path / "node-a-disk", tmp_path / "node-b-disk"
    mem_a, mem_b = _isolated_memory_folder / "node-a", _isolated_memory_folder / "node-b"
    run_id = f"nodeloss-{uuid.uuid4().hex[:8]}"
    with two_node_namespaces() as (a, b):
        job_a = _start_node(a, a, run_dir, disk_a, mem_a, run_id, tmp_path / "logs-a")
        job_b = _start_node(b, a, run_dir, disk_b, mem_b, run_id, tmp_path / "logs-b")
        _wait_holding(run_dir, [job_a, job_b], timeout_s=180.0)
        # Node A holds node B's replicas in memory (held slots) before the loss.
        assert len(list(mem_a.glob("run-*/topo-*/rank-*/held-*.slot"))) == 4

        killed = b.kill_all()
        assert job_b.pid in killed and b.pids() == []
        assert job_b.wait(10.0).returncode == -9
        shutil.rmtree(disk_b)  # the node's memory and local disk are gone with it
        shutil.rmtree(mem_b)
        shutil.rmtree(disk_a)  # and the survivor's disk too: only memory can serve
        (run_dir / HOLD_MARKER).touch()

        job_b2 = _start_node(b, a, run_dir, disk_b, mem_b, run_id, tmp_path / "logs-b2")
        run_a = job_a.wait(_JOB_TIMEOUT_S)
        run_b2 = job_b2.wait(60.0)
    assert run_a.returncode == 0, run_a.describe()
    assert run_b2.returncode == 0, run_b2.describe()

    summary = summarize(read_run_events(run_dir))
    rec = summary.recovery
    assert rec is not None
    assert rec.step == 10
    assert rec.walked_back_from == []
    assert rec.sources == {0: "own memory", 1: "own memory", 2: "peer memory", 3: "peer memory"}
    assert rec.bytes_moved > 0  # ranks 2 and 3 received their state over the network
    assert sorted(summary.finished) == [0, 1, 2, 3]
    # The replacement node's files are the resumed run's own captures (step 15, 20).
    assert sorted(p.name for p in disk_b.glob("run-*/topo-*/step-*")) == ["step-15", "step-20"]

    ref_dir = tmp_path / "reference"
    reference = start_job(
        DemoSpec(steps=_SPEC.steps, interval=_SPEC.interval, flush_interval=_SPEC.flush_interval),
        ref_dir,
        tmp_path / "reference-disk",
        nproc=4,
        run_id=f"reference-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
    ).wait(_JOB_TIMEOUT_S)
    assert reference.returncode == 0, reference.describe()
    comparison = compare_final(run_dir, ref_dir)
    assert comparison.identical, comparison
    ref_digests = summarize(read_run_events(ref_dir)).finished.values()
    assert len(set(summary.finished.values()) | set(ref_digests)) == 1

"""Disjoint checkpoint groups in one job share one run id and one topology identity.

A 4-rank job checkpoints in two groups of different shapes: rank 0 alone, ranks 1-3
together (replication_jump=1). Every rank derives the same job-wide fingerprint from
the ordered per-rank group fingerprints, the run id agreed without any configured id
is the job's, and each group keeps its own storage namespace, so the two groups'
``rank-0`` files and memory slots never meet: after the job ends, a restarted job
recovers every rank's own state bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.persistence import job_fingerprint, topology_fingerprint
from lm_resiliency.testing import run_distributed

_TIMEOUT_S = 180
_GROUPS = ([0], [1, 2, 3])


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"model": {"w": torch.randn(32, 17, generator=g)}, "data": {"offset": step * 4}}


def _manager(rank: int, disk: str, run_id: str | None) -> tuple[InMemoryCheckpointManager, int]:
    groups = [dist.new_group(g, backend="gloo") for g in _GROUPS]  # collective, every rank
    index = next(i for i, g in enumerate(_GROUPS) if rank in g)
    cfg = InMemoryCkptConfig(
        disk_folder=disk, disk_flush_interval=1, replication_jump=1, run_id=run_id
    )
    return InMemoryCheckpointManager(cfg, group=groups[index]), index


def _train(rank: int, world: int, disk: str) -> dict:
    m, index = _manager(rank, disk, None)
    steps = (4, 8) if index == 0 else (5, 10)  # the groups' cadences need not match
    for step in steps:
        m.save(_state(rank, step), step)
        m.maybe_wait()
    m.wait_persisted()
    out = {"run_id": m.run_id, "topology": m.topology, "namespace": m.namespace}
    m.close(finished=False)  # as a crashed job leaves: the slots and files stay
    return out


def _restart(rank: int, world: int, disk: str, run_id: str) -> dict:
    m, index = _manager(rank, disk, run_id)
    with m:
        step = m.find_latest()
        state = m.load(step) if step is not None else None
        same = state is not None and torch.equal(
            state["model"]["w"], _state(rank, step)["model"]["w"]
        )
        return {"step": step, "same": same, "topology": m.topology, "group": index}


def test_disjoint_checkpoint_groups_share_one_identity_and_each_recovers(tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    first = run_distributed(_train, 4, args=(disk,), timeout_s=_TIMEOUT_S)
    fp_alone = topology_fingerprint([0], [])
    fp_three = topology_fingerprint([1, 2, 3], [(1, 2), (2, 3), (3, 1)])
    expected = job_fingerprint([fp_alone, fp_three, fp_three, fp_three])
    assert {o["topology"] for o in first} == {expected}
    assert len({o["run_id"] for o in first}) == 1  # one fresh id for the whole job
    spaces = [o["namespace"] for o in first]
    assert spaces[1] == spaces[2] == spaces[3] != spaces[0] != expected
    run_id = first[0]["run_id"]
    # Both groups persisted a rank-0 shard under the same run, each in its own namespace.
    assert len(list(Path(disk).glob("run-*/topo-*/step-*/rank-0.safetensors"))) == 4

    again = run_distributed(_restart, 4, args=(disk, run_id), timeout_s=_TIMEOUT_S)
    assert [o["step"] for o in again] == [8, 10, 10, 10]
    assert all(o["same"] for o in again), again
    assert {o["topology"] for o in again} == {expected}

"""TorchTitan HSDP (``data_parallel_replicate_degree=2`` x ``data_parallel_shard_degree=2``).

4 CPU ranks under torchrun, the same debug llama3 model, shim and loop as
``test_torchtitan.py``. The ranks along TorchTitan's ``dp_replicate`` mesh
dimension hold byte-identical shards, so the adapter names them as natural
replicas: every rank keeps only its own two slots (no replica of a peer is
transferred). After step 7 rank 1 loses its node folder and memory and
SIGKILLs itself; the restarted group recovers step 6, rank 1's shards from
its natural replica (rank 3), and every rank's final state (shards, Adam
state, LR, scheduler, step, tokens, data position, generator) equals a
fault-free run's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from fw_runs import Job, assert_bit_identical
from torchtitan_runs import PYTESTMARK, jobs

pytestmark = PYTESTMARK


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Job]:
    tmp = tmp_path_factory.mktemp("torchtitan-hsdp")
    args = ["--steps", "8", "--interval", "3", "--dp-replicate", "2", "--dp-shard", "2"]
    run = jobs(tmp, args)

    def job(name: str, *extra: str, restarts: int = 0) -> Job:
        return run(name, *extra, nproc=4, restarts=restarts)

    return job("crash", "--fault-step", "7", restarts=1), job("reference")


def test_replicate_dimension_gives_natural_replicas(runs: tuple[Job, Job]) -> None:
    crash, _ = runs
    for rank in range(4):
        first = crash.reports[(0, rank)]
        assert first["inner"] == "hsdp"
        assert first["replica_ranks"] == [rank % 2, rank % 2 + 2]
        assert first["slots"] == ["own_current", "own_previous"]  # no peer replica slots


def test_lost_rank_recovers_from_its_natural_replica(runs: tuple[Job, Job]) -> None:
    crash, _ = runs
    assert crash.run.attempts == 2, crash.run.describe()
    for rank in range(4):
        resumed = crash.reports[(1, rank)]
        assert (resumed["source"], resumed["start_step"], resumed["first_step"]) == ("gemini", 6, 7)
    sources = crash.reports[(1, 0)]["sources"]
    assert sources[1] != "own memory" and sources[3] == "own memory"


def test_final_state_is_bit_identical_to_a_fault_free_run(runs: tuple[Job, Job]) -> None:
    crash, reference = runs
    assert_bit_identical(crash, reference)
    for rank in range(4):
        assert crash.reports[(1, rank)]["dataloader"] == reference.reports[(0, rank)]["dataloader"]
    emb = [f["param.tok_embeddings.weight"] for f in crash.finals]
    assert torch.equal(emb[1], emb[3]) and not torch.equal(emb[0], emb[1])

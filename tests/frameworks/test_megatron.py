"""Megatron Core under torchrun: SIGKILL a rank, recover, finish bit-identical.

Megatron Core 0.16 (GPTModel with dropout, its DDP, the distributed optimizer,
an OptimizerParamScheduler) on 2 CPU ranks behind the test-only
``megatron_cpu_shim`` (its doc lists exactly what it patches and why). Same
fault as the DeepSpeed test: after step 7 rank 1 loses its node folder and
SIGKILLs itself; its main-param shards come back from rank 0. The final shards,
Adam state, model params, LR, scheduler count and RNG tracker states must equal
a fault-free run's bit for bit.

Skipped where Megatron Core is not installed (``make extras`` installs it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from fw_runs import Job, assert_bit_identical, run_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None,
        reason="Megatron Core is not installed; `make extras` (pip install -e .[megatron]) adds it",
    ),
]

WORKER = Path(__file__).with_name("megatron_worker.py")
_ARGS = ["--steps", "8", "--interval", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Job]:
    tmp = tmp_path_factory.mktemp("megatron")
    crash = run_job(WORKER, tmp, "crash", [*_ARGS, "--fault-step", "7"], max_restarts=1)
    return crash, run_job(WORKER, tmp, "reference", _ARGS)


def test_restarted_group_resumes_from_the_newest_common_step(runs: tuple[Job, Job]) -> None:
    crash, _ = runs
    assert crash.run.attempts == 2, crash.run.describe()
    for rank in (0, 1):
        assert crash.reports[(0, rank)]["source"] == "fresh"
        resumed = crash.reports[(1, rank)]
        assert (resumed["source"], resumed["start_step"]) == ("gemini", 6)
        assert resumed["scheduler_steps"] == 6  # the scheduler restored with the shards


def test_lost_rank_shards_come_back_from_its_peer(runs: tuple[Job, Job]) -> None:
    crash, _ = runs
    # rank 0's memory slots outlived its process; rank 1 lost its memory and disk with its
    # node, so its partition came back from the replica rank 0 holds in memory
    assert crash.reports[(1, 0)]["sources"] == ["own memory", "peer memory"]


def test_final_state_is_bit_identical_to_a_fault_free_run(runs: tuple[Job, Job]) -> None:
    crash, reference = runs
    compared = assert_bit_identical(crash, reference)
    finals = crash.finals[0]
    assert any(k.startswith("rng.") and k != "rng.default" for k in finals)  # tracker states
    assert sum(k.startswith("master.") for k in finals) >= 2
    assert compared > 2 * 30, compared
    shards = [f["master.0.0"] for f in crash.finals]
    assert not torch_equal(shards[0], shards[1])  # each rank owns a different shard


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.shape == b.shape and bool(torch.equal(a, b))

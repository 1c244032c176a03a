"""TorchTitan under torchrun: SIGKILL a rank inside ``trainer.train()``, recover, bit-identical.

TorchTitan 0.3.0's debug llama3 model (random init, seed 0) on a local
tokenizer and dataset, FSDP2 over 2 CPU ranks (``data_parallel_shard_degree=2``)
behind the test-only ``torchtitan_cpu_shim`` (its doc lists exactly what it
patches and why); the loop is TorchTitan's own ``trainer.train()``, and
TorchTitan's DCP checkpointer saves every 4 steps. Same fault as the other
framework tests: after step 7 rank 1 loses its node folder and SIGKILLs
itself; its shards come back from rank 0. The restarted ``train()`` must begin
at step 7 although a DCP checkpoint of step 4 exists (its own load at the
start of ``train()`` must not undo the GEMINI restore), and the final
parameters, Adam state, LR, scheduler epoch, step, tokens seen, data-loader
position and default generator must equal a fault-free run's bit for bit.

The durable fallback: GEMINI never captures (interval above the run), the
restarted group resumes from TorchTitan's DCP checkpoint of step 4 with no
user code, and finishes bit-identical too except the default generator
(TorchTitan's DCP checkpoint does not hold it).

SCOUT's durable candidates (the adapter's ``durable_candidate()`` writer, driven by
the worker at the pre-step hooks where SCOUT's pipelined verdict calls it): a
candidate is a complete DCP checkpoint that TorchTitan's own discovery does not
see; once verified it is TorchTitan's ``step-N``; a rejected one is gone. With
GEMINI lost on every rank, the restarted group resumes from the verified candidate
(not the newer unresolved one) and finishes bit-identical except the generator: the
candidate, written a step after its capture, holds that capture's data position.

Skipped where TorchTitan is not installed (``make extras`` installs it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fw_runs import Job, assert_bit_identical
from torchtitan_runs import PYTESTMARK, jobs

pytestmark = PYTESTMARK

# At the pre-hook of step S: write / verify / reject the candidate of step N. GEMINI
# captures every 2 steps, so each candidate is of the capture one step before.
_EVENTS = "3:write:2,5:verified:2,5:write:4,7:rejected:4,7:write:6"
_LOSE_ALL_AT_7 = ("--fault-step", "7", "--fault-all")
_DRIVE = ("--candidate-events", _EVENTS)
_JOBS: dict[str, tuple[tuple[str, ...], int]] = {
    "crash": (("--interval", "3", "--fault-step", "7"), 1),
    "reference": (("--interval", "3"), 0),
    "fallback": (("--interval", "100", "--fault-step", "6"), 1),
    "candidates": (("--interval", "2", "--dcp-interval", "100", *_LOSE_ALL_AT_7, *_DRIVE), 1),
}


class _Runs:
    """The module's torchrun jobs, each run once when a test first reads it."""

    def __init__(self, tmp: Path, job: Callable[..., Job]) -> None:
        self.tmp, self._job = tmp, job
        self._done: dict[str, Job] = {}

    def __getitem__(self, name: str) -> Job:
        if name not in self._done:
            extra, restarts = _JOBS[name]
            self._done[name] = self._job(name, *extra, restarts=restarts)
        return self._done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    tmp = tmp_path_factory.mktemp("torchtitan")
    return _Runs(tmp, jobs(tmp, ["--steps", "8", "--dcp-interval", "4"]))


def test_restarted_group_resumes_from_gemini_not_the_older_dcp_checkpoint(
    runs: _Runs,
) -> None:
    crash = runs["crash"]
    assert crash.run.attempts == 2, crash.run.describe()
    for rank in (0, 1):
        assert crash.reports[(0, rank)]["source"] == "fresh"
        resumed = crash.reports[(1, rank)]
        assert resumed["dcp_steps"] == [4]  # an older durable checkpoint was there
        assert (resumed["source"], resumed["start_step"]) == ("gemini", 6)
        assert resumed["trainer_step"] == 6
        # train() began at step 7: its own DCP load (step 4) was skipped
        assert resumed["first_step"] == 7


def test_lost_rank_shards_come_back_from_its_peer(runs: _Runs) -> None:
    assert runs["crash"].reports[(1, 0)]["sources"] == ["own memory", "peer memory"]


def test_final_state_is_bit_identical_to_a_fault_free_run(runs: _Runs) -> None:
    crash, reference = runs["crash"], runs["reference"]
    compared = assert_bit_identical(crash, reference)
    finals = crash.finals[0]
    assert sum(k.startswith("param.") for k in finals) > 40
    assert sum(k.endswith(".exp_avg_sq") for k in finals) > 40
    assert int(finals["step"]) == 8 and int(finals["last_epoch"]) == 8
    assert compared == len(finals) * 2
    for rank in (0, 1):
        loader = crash.reports[(1, rank)]["dataloader"]
        assert loader == reference.reports[(0, rank)]["dataloader"]
    shards = [f["param.tok_embeddings.weight"] for f in crash.finals]
    assert shards[0].shape == shards[1].shape and not torch.equal(shards[0], shards[1])


def test_without_a_gemini_step_torchtitan_dcp_checkpoint_is_the_fallback(
    runs: _Runs,
) -> None:
    fallback = runs["fallback"]
    assert fallback.run.attempts == 2, fallback.run.describe()
    for rank in (0, 1):
        resumed = fallback.reports[(1, rank)]
        assert (resumed["source"], resumed["start_step"]) == ("fallback", 4)
        assert resumed["first_step"] == 5  # the DCP checkpoint was loaded once, by the fallback
    # TorchTitan's DCP checkpoint holds no generator state (and its load plans with the
    # data loader's state_dict(), which draws a base seed): the generator is the one
    # thing a DCP resume does not reproduce. Everything else must be identical.
    assert_bit_identical(_without_rng(fallback), _without_rng(runs["reference"]))


def _without_rng(job: Job) -> Job:
    finals = [{k: v for k, v in f.items() if k != "rng.default"} for f in job.finals]
    return dataclasses.replace(job, finals=finals)


def test_durable_candidates_are_invisible_to_torchtitan_until_verified(runs: _Runs) -> None:
    runs["candidates"]
    log = json.loads((runs.tmp / "candidates" / "candidates-rank-0.json").read_text())
    seen = [(e["at"], e["event"], e["load"], e["folders"]) for e in log]
    assert seen == [
        (3, "write 2", -1, ["scout-candidate-2"]),  # complete, yet TorchTitan finds no step
        (5, "verified 2", 2, ["step-2"]),  # promoted: TorchTitan's own name
        (5, "write 4", 2, ["scout-candidate-4", "step-2"]),
        (7, "rejected 4", 2, ["step-2"]),  # removed
        (7, "write 6", 2, ["scout-candidate-6", "step-2"]),  # the job dies before its verdict
    ]


def test_the_fallback_resumes_from_the_verified_candidate_bit_identical(runs: _Runs) -> None:
    job = runs["candidates"]
    assert job.run.attempts == 2, job.run.describe()
    for rank in (0, 1):
        resumed = job.reports[(1, rank)]
        assert resumed["dcp_folders"] == ["scout-candidate-6", "step-2"]
        assert (resumed["source"], resumed["start_step"]) == ("fallback", 2)
        assert resumed["first_step"] == 3
    # The candidate of step 2 was written at step 3's pre-hook, when the loader and the
    # token count were past step 3's batches: it holds the capture's, so the resumed run
    # trains on the same batches (the data-loader position is compared too).
    for rank in (0, 1):
        loader = job.reports[(1, rank)]["dataloader"]
        assert loader == runs["reference"].reports[(0, rank)]["dataloader"]
    assert_bit_identical(_without_rng(job), _without_rng(runs["reference"]))

"""DeepSpeed ZeRO-1/2/3 under torchrun: SIGKILL a rank, recover, finish bit-identical.

Real DeepSpeed on CPU (Gloo, 2 ranks, ``torch_adam``), driven by
``deepspeed_worker.py``. Each rank is its own simulated node (own node-local
folder). After step 7 every rank has persisted step 6 (its own partition and
the replica of its peer's); rank 1 then loses its node folder and SIGKILLs
itself; torchrun restarts the group. Rank 1's partition can only come back
from rank 0, its peer. The final masters, Adam state, low-precision params, LR
and step counter, and (ZeRO-1 and 3, in fp32) the BatchNorm statistics (module
buffers) must equal a fault-free run's bit for bit.

The fallback case captures nothing with GEMINI (interval beyond the run) and
saves DeepSpeed checkpoints every 4 steps: the restarted job resumes from
DeepSpeed's ``load_checkpoint`` without user code and also finishes identical.

The data-loader case feeds the loop from a real ``StatefulDataLoader`` (a
shuffled ``DistributedSampler``, augmentation noise from the global RNG) given
to ``state=``: the capture must take its position and the RNGs at the
optimizer step, before the loop fetches the next batch, so the resumed run
trains on exactly the samples a fault-free run trains on.

SCOUT's durable candidates (``durable_candidates(engine, dir)``, driven by the worker
at the optimizer pre-hooks where SCOUT's pipelined verdict calls it): a candidate is
saved with ``save_latest=False`` (``latest`` does not move); once verified ``latest``
names it; a rejected one is removed. With GEMINI lost on every rank the restarted
job loads ``latest``: the verified candidate, not the newer unresolved one, and
finishes identical to a fault-free run.

Skipped where DeepSpeed is not installed (``make extras`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from fw_runs import Job, assert_bit_identical, run_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="DeepSpeed is not installed; `make extras` (pip install -e .[deepspeed]) adds it",
    ),
]

WORKER = Path(__file__).with_name("deepspeed_worker.py")
_STEPS, _INTERVAL, _FAULT_STEP = 8, 3, 7
_CASES = {1: [], 2: ["--bf16"], 3: []}  # ZeRO-2 in bf16: low-precision params re-derived


def _job(tmp: Path, name: str, stage: int, *extra: str, restarts: int = 0) -> Job:
    args = ["--stage", str(stage), "--steps", str(_STEPS), *_CASES[stage], *extra]
    return run_job(WORKER, tmp, name, args, max_restarts=restarts)


class _Jobs:
    """The module's torchrun jobs, each run once and shared by the tests that read it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.done: dict[str, Job] = {}

    def get(self, name: str, stage: int, *extra: str, restarts: int = 0) -> Job:
        key = f"zero{stage}-{name}"
        if key not in self.done:
            self.done[key] = _job(self.tmp / key, name, stage, *extra, restarts=restarts)
        return self.done[key]

    def reference(self, stage: int) -> Job:
        return self.get("reference", stage, "--interval", str(_INTERVAL))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> _Jobs:
    return _Jobs(tmp_path_factory.mktemp("deepspeed"))


@pytest.fixture(scope="module", params=sorted(_CASES), ids=lambda s: f"zero{s}")
def runs(request: pytest.FixtureRequest, jobs: _Jobs) -> tuple[int, Job, Job]:
    stage = request.param
    crash = jobs.get(
        "crash",
        stage,
        *("--interval", str(_INTERVAL), "--fault-step", str(_FAULT_STEP)),
        restarts=1,
    )
    return stage, crash, jobs.reference(stage)


def test_restarted_group_resumes_from_the_newest_common_step(runs: tuple[int, Job, Job]) -> None:
    _, crash, _ = runs
    assert crash.run.attempts == 2, crash.run.describe()
    for rank in (0, 1):
        assert crash.reports[(0, rank)]["source"] == "fresh"
        resumed = crash.reports[(1, rank)]
        assert resumed["source"] == "gemini"
        assert resumed["start_step"] == 6  # captured at 3 and 6; killed after 7
        assert resumed["global_steps"] == 6  # the engine's counter restored with it


def test_lost_rank_partition_comes_back_from_its_peer(runs: tuple[int, Job, Job]) -> None:
    _, crash, _ = runs
    # Rank 1's node folder is gone: its ZeRO partition exists only as rank 0's replica.
    # rank 0's memory slots outlived its process; rank 1 lost its memory and disk with its
    # node, so its partition came back from the replica rank 0 holds in memory
    assert crash.reports[(1, 0)]["sources"] == ["own memory", "peer memory"]


def test_final_state_is_bit_identical_to_a_fault_free_run(runs: tuple[int, Job, Job]) -> None:
    stage, crash, reference = runs
    compared = assert_bit_identical(crash, reference)
    # per rank: masters + step/exp_avg/exp_avg_sq per group, 6 params, lr, counter
    assert compared >= 2 * (4 + 6 + 2), (stage, compared)
    assert (crash.finals[0]["master.0"] != crash.finals[1]["master.0"]).any()  # rank-unique


def test_durable_fallback_resumes_from_deepspeeds_checkpoint(jobs: _Jobs) -> None:
    stage = 1  # the fallback path is the same for every stage
    durable = jobs.tmp / "ds-ckpt"
    fallback = jobs.get(
        "fallback",
        stage,
        *("--interval", "100", "--fault-step", "6"),
        *("--durable-dir", str(durable), "--durable-every", "4"),
        restarts=1,
    )
    for rank in (0, 1):
        resumed = fallback.reports[(1, rank)]
        assert (resumed["source"], resumed["start_step"]) == ("fallback", 4)
        assert resumed["sources"] == ["fallback", "fallback"]
    # DeepSpeed's checkpoint holds rank 0's module only (mp_rank_00_model_states.pt), so
    # every rank loads rank 0's BatchNorm statistics: rank 1's own are lost there (GEMINI
    # captures them per rank). Rank 0 is compared in full, rank 1 without its buffers.
    compared = assert_bit_identical(
        fallback, jobs.reference(stage), skip=lambda rank, key: rank == 1 and "buffer." in key
    )
    assert compared >= 2 * (4 + 6 + 2), compared


def _consumed(jobs: _Jobs, key: str, job: Job, rank: int) -> list[list[int]]:
    """``[step, *sample ids]`` per step as the run kept them: a restarted generation's
    steps replace those the killed one took after the step it resumed from."""
    run_dir = jobs.tmp / key / key.split("-", 1)[1]
    rows: list[list[int]] = []
    for attempt in sorted(a for a, r in job.reports if r == rank):
        start = job.reports[(attempt, rank)]["start_step"]
        rows = [row for row in rows if row[0] <= start]
        rows += json.loads((run_dir / f"ids-attempt-{attempt}-rank-{rank}.json").read_text())
    return rows


@pytest.mark.skipif(
    importlib.util.find_spec("torchdata") is None, reason="needs torchdata's StatefulDataLoader"
)
def test_a_real_data_loader_resumes_at_the_batch_after_the_captured_step(jobs: _Jobs) -> None:
    stage = 1  # the capture point is the same for every stage
    loop = ("--loader", "--interval", str(_INTERVAL))
    crash = jobs.get("loader_crash", stage, *loop, "--fault-step", str(_FAULT_STEP), restarts=1)
    reference = jobs.get("loader_reference", stage, *loop)
    for rank in (0, 1):
        assert crash.reports[(1, rank)]["start_step"] == 6, crash.run.describe()
        resumed = _consumed(jobs, f"zero{stage}-loader_crash", crash, rank)
        fault_free = _consumed(jobs, f"zero{stage}-loader_reference", reference, rank)
        assert [row[0] for row in fault_free] == list(range(1, _STEPS + 1))
        # Step 7 trains on the batch after step 6's, not one batch further on.
        assert resumed == fault_free, (rank, resumed, fault_free)
        ids = [i for row in fault_free for i in row[1:]]
        assert len(set(ids)) == len(ids) == 4 * _STEPS  # one epoch, no sample twice
    # The augmentation noise drawn at each fetch is identical too (the global RNG).
    compared = assert_bit_identical(crash, reference)
    assert compared >= 2 * (4 + 6 + 2), compared


def test_durable_candidates_become_latest_only_once_verified(jobs: _Jobs) -> None:
    stage = 1  # the engine's save/load is the same for every stage
    durable = jobs.tmp / "ds-candidates"
    events = "3:write:2,5:verified:2,5:write:4,7:rejected:4,7:write:6"
    job = jobs.get(
        "candidates",
        stage,
        *("--interval", "2", "--fault-step", "7", "--fault-all"),
        *("--durable-dir", str(durable), "--candidate-events", events),
        restarts=1,
    )
    log = json.loads(
        (jobs.tmp / "zero1-candidates" / "candidates" / "candidates-rank-0.json").read_text()
    )
    seen = [(e["at"], e["event"], e["latest"], e["tags"]) for e in log]
    c = "scout-candidate-"
    assert seen == [
        (3, "write 2", None, [f"{c}2"]),  # saved, and latest does not name it
        (5, "verified 2", f"{c}2", [f"{c}2"]),
        (5, "write 4", f"{c}2", [f"{c}2", f"{c}4"]),
        (7, "rejected 4", f"{c}2", [f"{c}2"]),  # removed
        (7, "write 6", f"{c}2", [f"{c}2", f"{c}6"]),  # the job dies before its verdict
    ]
    assert job.run.attempts == 2, job.run.describe()
    for rank in (0, 1):
        resumed = job.reports[(1, rank)]
        assert resumed["tags"] == [f"{c}2", f"{c}6"]
        assert (resumed["source"], resumed["start_step"], resumed["global_steps"]) == (
            "fallback",
            2,
            2,
        )
    # As in the fallback test: DeepSpeed's checkpoint holds rank 0's module buffers only.
    compared = assert_bit_identical(
        job, jobs.reference(stage), skip=lambda rank, key: rank == 1 and "buffer." in key
    )
    assert compared >= 2 * (4 + 6 + 2), compared

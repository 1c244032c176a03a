"""Crash and restart under the real torchrun agent, recovered from memory that outlived it.

The scenario of issue #11: 4 demo workers (``lm_resiliency.demo.worker``: tiny
GPT, DDP, Gloo, the contract's plain loop with no error handling) capture every
5 steps with periodic flushing *off*. After step 23 of 40 rank 1 SIGKILLs
itself; the survivors' next collective fails and they exit on that error;
torchrun restarts the group (``--max-restarts=1``). Step 20 lives on in every
rank's memory slot files on /dev/shm, so the new workers re-attach to them,
agree on step 20, restore it from their own memory (no bytes over the network,
nothing read from disk) and finish bit-identical to a fault-free run.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lm_resiliency.demo.events import read_run_events
from lm_resiliency.demo.launch import DemoSpec, compare_final, start_job
from lm_resiliency.demo.timeline import RunSummary, summarize

pytestmark = pytest.mark.slow

_JOB_TIMEOUT_S = 300.0
_WORLD = 4
_STEPS, _INTERVAL, _FAULT_STEP, _VICTIM = 40, 5, 23, 1


def _run(
    tmp: Path, name: str, spec: DemoSpec, max_restarts: int, memory: Path
) -> tuple[Path, RunSummary]:
    run_dir = tmp / name
    job = start_job(
        spec,
        run_dir,
        tmp / f"{name}-disk",
        nproc=_WORLD,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        max_restarts=max_restarts,
        env={"LM_RESILIENCY_MEMORY_FOLDER": str(memory / name)},
    )
    done = job.wait(_JOB_TIMEOUT_S)
    assert done.returncode == 0, done.describe()
    assert done.attempts == 1 + max_restarts, done.describe()
    return run_dir, summarize(read_run_events(run_dir))


@pytest.fixture(scope="module")
def memory() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="lmr-crash-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, memory: Path
) -> dict[str, tuple[Path, RunSummary]]:
    tmp = tmp_path_factory.mktemp("crash")
    base = {"steps": _STEPS, "interval": _INTERVAL, "flush_interval": 0, "pg_timeout_s": 60.0}
    crash = DemoSpec(**base, fault_step=_FAULT_STEP, fault_rank=_VICTIM)
    return {
        "crash": _run(tmp, "crash", crash, 1, memory),
        "reference": _run(tmp, "reference", DemoSpec(**base), 0, memory),
    }


def test_restarted_group_recovers_step_20_from_its_own_memory(
    runs: dict[str, tuple[Path, RunSummary]],
) -> None:
    _, summary = runs["crash"]
    assert summary.generations == 2
    rec = summary.recovery
    assert rec is not None
    assert (rec.step, rec.fault_step, rec.fault_rank, rec.lost_steps) == (20, 23, 1, 3)
    assert rec.walked_back_from == []
    assert rec.sources == {r: "own memory" for r in range(_WORLD)}
    assert rec.bytes_moved == 0
    assert summary.last_step == _STEPS


def test_the_finished_run_removed_its_memory_slots(
    runs: dict[str, tuple[Path, RunSummary]], memory: Path
) -> None:
    # close() after the last step: the run is finished, its slots are gone
    assert (memory / "crash").is_dir()
    assert list((memory / "crash").glob("run-*/topo-*/rank-*/*.slot")) == []


def test_final_state_is_bit_identical_to_a_fault_free_run(
    runs: dict[str, tuple[Path, RunSummary]],
) -> None:
    crash_dir, crash = runs["crash"]
    ref_dir, reference = runs["reference"]
    assert reference.recovery is None
    comparison = compare_final(crash_dir, ref_dir)
    assert comparison.identical, comparison
    assert comparison.tensors > 50  # parameters and AdamW state of every parameter
    digests = set(crash.finished.values()) | set(reference.finished.values())
    assert sorted(crash.finished) == list(range(_WORLD))
    assert len(digests) == 1

"""Crash and restart under the real torchrun agent, recovered through GEMINI node-local files.

4 demo workers (``lm_resiliency.demo.worker``: tiny GPT, DDP, Gloo) capture every
5 steps with periodic flushing *off*, so the only node-local files are the ones
GEMINI's SIGTERM handler writes. After step 17 rank 1 SIGKILLs itself; torchrun
SIGTERMs the survivors and restarts the group (``--max-restarts=1``). Step 15 is
then on disk only if the survivors flushed on SIGTERM: their own state, and rank
3's replica of the dead rank 1 (rank 1 never wrote anything). The new workers
must agree on step 15, restore it and finish bit-identical to a fault-free run
of the same seed.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from lm_resiliency.demo.events import read_events
from lm_resiliency.demo.launch import DemoSpec, compare_final, start_job
from lm_resiliency.demo.timeline import RunSummary, summarize

pytestmark = pytest.mark.slow

_JOB_TIMEOUT_S = 300.0
_WORLD = 4
_STEPS, _INTERVAL, _FAULT_STEP, _VICTIM = 24, 5, 17, 1


def _run(tmp: Path, name: str, spec: DemoSpec, max_restarts: int) -> tuple[Path, RunSummary]:
    run_dir = tmp / name
    job = start_job(
        spec,
        run_dir,
        tmp / f"{name}-disk",
        nproc=_WORLD,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        max_restarts=max_restarts,
    )
    done = job.wait(_JOB_TIMEOUT_S)
    assert done.returncode == 0, done.describe()
    assert done.attempts == 1 + max_restarts, done.describe()
    return run_dir, summarize(read_events(run_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, RunSummary]]:
    tmp = tmp_path_factory.mktemp("crash")
    base = {"steps": _STEPS, "interval": _INTERVAL, "flush_interval": 0, "pg_timeout_s": 60.0}
    crash = DemoSpec(**base, fault_step=_FAULT_STEP, fault_rank=_VICTIM)
    return {
        "crash": _run(tmp, "crash", crash, max_restarts=1),
        "reference": _run(tmp, "reference", DemoSpec(**base), max_restarts=0),
    }


def test_survivors_flush_their_newest_own_and_peer_slot_on_sigterm(
    runs: dict[str, tuple[Path, RunSummary]],
) -> None:
    _, summary = runs["crash"]
    survivors = [r for r in range(_WORLD) if r != _VICTIM]
    assert summary.sigterm_ranks == survivors
    assert sorted(summary.flushed_on_sigterm) == survivors
    for rank in survivors:
        slots = summary.flushed_on_sigterm[rank]  # what the signal flush itself wrote
        assert sorted(slots) == ["own_current", "peer_current"]
        assert slots["own_current"] == {"owner": rank, "state": "PERSISTED", "step": 15}
        peer = (rank + 2) % _WORLD  # one node: ranks pair half the world apart
        assert slots["peer_current"] == {"owner": peer, "state": "PERSISTED", "step": 15}


def test_flushed_files_exist_for_every_rank_including_the_dead_one(
    runs: dict[str, tuple[Path, RunSummary]],
) -> None:
    run_dir, _ = runs["crash"]
    step_dirs = sorted((run_dir.parent / "crash-disk").glob("run-*/topo-*/step-15"))
    assert len(step_dirs) == 1
    assert sorted(p.name for p in step_dirs[0].iterdir()) == [
        f"rank-{r}.safetensors" for r in range(_WORLD)
    ]


def test_restarted_group_recovers_the_newest_common_step_from_disk(
    runs: dict[str, tuple[Path, RunSummary]],
) -> None:
    _, summary = runs["crash"]
    assert summary.generations == 2
    rec = summary.recovery
    assert rec is not None
    assert (rec.step, rec.fault_step, rec.fault_rank, rec.lost_steps) == (15, 17, 1, 2)
    assert rec.walked_back_from == []
    # All ranks share the node's folder, so rank 1's step 15 (written by rank 3
    # from its replica) is a node-local file of its own state.
    assert rec.sources == {r: "own disk" for r in range(_WORLD)}
    assert rec.bytes_moved == 0
    assert summary.last_step == _STEPS


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

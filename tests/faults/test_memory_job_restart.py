"""A whole-job restart on one node recovers from memory; a job with another run id does not.

Job A (2 demo workers under torchrun, periodic flush off) trains to step 12
(captures at 5 and 10) and idles; the test then SIGKILLs the agent and both
workers at once. A job with another run id starts from scratch on the same node
(it never sees A's slots). Then a new torchrun with A's run id re-attaches to the
slots A's workers left on /dev/shm, recovers step 10 from memory on every rank
and finishes bit-identical to a fault-free run.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from lm_resiliency.demo.events import read_run_events
from lm_resiliency.demo.launch import DemoSpec, compare_final, start_job
from lm_resiliency.demo.timeline import summarize

pytestmark = pytest.mark.slow

_TIMEOUT_S = 240.0
_BASE = {"steps": 20, "interval": 5, "flush_interval": 0, "pg_timeout_s": 60.0}


def _wait_for(run_dir: Path, event: str, ranks: set[int], job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while {r["rank"] for r in read_run_events(run_dir) if r["event"] == event} != ranks:
        assert job.poll() is None, job.stdout_so_far()
        assert time.monotonic() < deadline, f"no {event} from every rank"
        time.sleep(0.1)


def test_a_whole_job_restart_recovers_from_memory_and_another_run_never_sees_it(
    tmp_path: Path,
) -> None:
    run_id = f"whole-job-{uuid.uuid4().hex[:8]}"
    disk = tmp_path / "disk"
    first = tmp_path / "first"
    job = start_job(DemoSpec(**_BASE, hold_step=12), first, disk, nproc=2, run_id=run_id)
    _wait_for(first, "holding", {0, 1}, job, _TIMEOUT_S)
    job.crash()  # every worker and the agent, at once

    other = tmp_path / "other"
    done = start_job(DemoSpec(**{**_BASE, "steps": 6}), other, disk, nproc=2,
                     run_id=f"{run_id}-other", max_restarts=0).wait(_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert summarize(read_run_events(other)).recovery is None  # a fresh start

    again = tmp_path / "again"
    done = start_job(DemoSpec(**_BASE), again, disk, nproc=2, run_id=run_id,
                     max_restarts=0).wait(_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.describe()
    summary = summarize(read_run_events(again))
    rec = summary.recovery
    assert rec is not None and rec.step == 10
    assert rec.sources == {0: "own memory", 1: "own memory"}
    assert rec.bytes_moved == 0 and not list(disk.glob("run-*/topo-*/step-*"))

    reference = tmp_path / "reference"
    done = start_job(DemoSpec(**_BASE), reference, tmp_path / "ref-disk", nproc=2,
                     run_id=f"{run_id}-ref", max_restarts=0).wait(_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert compare_final(again, reference).identical

"""Two whole-job SIGKILLs in a row: the second restart still recovers from own memory.

Job A (2 demo workers under torchrun, flush off) trains to step 12 (captures at
5 and 10) and idles; the test SIGKILLs the agent and both workers at once. Job B
(same run id) recovers step 10 from own memory, trains to step 13 -- before its
first capture (15) -- and idles; it is SIGKILLed whole the same way. Job C should
again recover step 10 from *own* memory on every rank.

Issue 20 item 14: job B's ``commit_restore()`` hands its own slot of step 10
over (zero-copy: the file leaves the memory folder, the optimizer state aliases
its arena). Before the fix nothing re-created an own copy, so until B's first
capture committed, the peer's replica was the only in-memory copy of step 10 and
job C recovered from *peer memory* on every rank ("own memory has no step 10 (it
holds [5])"). Now the hand-over copies step 10 back into a fresh own slot file
in the background.
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


def test_a_second_whole_job_kill_before_the_next_capture_still_recovers_from_own_memory(
    tmp_path: Path,
) -> None:
    run_id = f"twice-{uuid.uuid4().hex[:8]}"
    disk = tmp_path / "disk"
    first = tmp_path / "first"
    job = start_job(DemoSpec(**_BASE, hold_step=12), first, disk, nproc=2, run_id=run_id)
    _wait_for(first, "holding", {0, 1}, job, _TIMEOUT_S)
    job.crash()  # every worker and the agent, at once

    second = tmp_path / "second"
    job = start_job(DemoSpec(**_BASE, hold_step=13), second, disk, nproc=2, run_id=run_id)
    _wait_for(second, "holding", {0, 1}, job, _TIMEOUT_S)
    job.crash()
    rec = summarize(read_run_events(second)).recovery
    assert rec is not None and rec.step == 10
    assert rec.sources == {0: "own memory", 1: "own memory"}

    third = tmp_path / "third"
    done = start_job(DemoSpec(**_BASE), third, disk, nproc=2, run_id=run_id,
                     max_restarts=0).wait(_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.describe()
    rec = summarize(read_run_events(third)).recovery
    assert rec is not None and rec.step == 10
    assert rec.sources == {0: "own memory", 1: "own memory"}
    assert rec.bytes_moved == 0 and not list(disk.glob("run-*/topo-*/step-*"))

    reference = tmp_path / "reference"
    done = start_job(DemoSpec(**_BASE), reference, tmp_path / "ref-disk", nproc=2,
                     run_id=f"{run_id}-ref", max_restarts=0).wait(_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert compare_final(third, reference).identical

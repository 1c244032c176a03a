"""Two jobs under one run id: a job of another topology never deletes the first job's slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.testing import run_distributed

_RUN = "namespaces-test"


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"model": {"w": torch.randn(64, 33, generator=g)}, "sampler": {"offset": step * 8}}


def _cfg(disk: str) -> InMemoryCkptConfig:
    return InMemoryCkptConfig(disk_folder=disk, disk_flush_interval=0, run_id=_RUN)


def _train_then_die(rank: int, world: int, disk: str) -> None:
    m = InMemoryCheckpointManager(_cfg(disk))
    for step in (5, 10):
        m.save(_state(rank, step), step)
        m.maybe_wait()
    m.wait_persisted()
    m.close(finished=False)  # leaving on an error: the slots stay for the restarted job


def _restart(rank: int, world: int, disk: str) -> dict:
    with InMemoryCheckpointManager(_cfg(disk)) as m:
        step = m.find_latest()
        state = m.load(step) if step is not None else None
        expected = _state(rank, 10)["model"]["w"]
        same = state is not None and torch.equal(state["model"]["w"], expected)
        return {"step": step, "sources": m.last_restore.sources, "same": same}


def test_a_run_with_another_world_size_keeps_the_original_topologys_slots(tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    run_distributed(_train_then_die, 2, args=(disk,), timeout_s=120)
    # The operator's mistake: the same run id with world size 1 runs to the end.
    with InMemoryCheckpointManager(_cfg(disk)) as single:
        assert single.find_latest() is None  # another topology's slots are not its own
        single.save(_state(0, 3), 3)
        single.maybe_wait()
    out = run_distributed(_restart, 2, args=(disk,), timeout_s=120)
    for o in out:
        assert o["step"] == 10 and o["same"], o
        assert o["sources"] == ["own memory", "own memory"], o


_HOLDER = """
import sys, time, torch
from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
cfg = InMemoryCkptConfig(disk_folder=sys.argv[1], disk_flush_interval=1, memory_folder=None,
                         run_id=sys.argv[2], signal_flush=False)
m = InMemoryCheckpointManager(cfg)
for step in (1, 2):
    m.save({"w": torch.full((8,), float(step))}, step)
    m.maybe_wait()
m.wait_persisted()
print("holding", flush=True)
sys.stdin.readline()  # until the test closes our stdin
m.close(finished=False)  # leaves as a crashed job would: its run is not finished
"""


def test_a_second_live_job_with_the_same_run_id_and_disk_folder_is_refused(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from lm_resiliency import ResiliencyError

    disk = tmp_path / "disk"
    job_a = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(disk), "shared-run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job_a.stdout is not None and job_a.stdout.readline().strip() == "holding"
        cfg = InMemoryCkptConfig(
            disk_folder=str(disk), memory_folder=None, run_id="shared-run", signal_flush=False
        )
        with pytest.raises(
            ResiliencyError, match=rf"in use by another live job \(pid {job_a.pid} "
        ):
            InMemoryCheckpointManager(cfg)
    finally:
        assert job_a.stdin is not None
        job_a.stdin.close()
        assert job_a.wait(timeout=60) == 0
    # Once job A is gone, its lock is free: a restart of the run recovers A's step 2.
    with InMemoryCheckpointManager(cfg) as m:
        assert m.find_latest() == 2


def test_every_recovery_prints_one_line_without_any_logging_setup(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(str(tmp_path / "disk"))
    with InMemoryCheckpointManager(cfg, load_fallback=lambda: "durable") as m:
        assert m.load() == "durable"  # nothing captured yet: the fallback
        m.save(_state(0, 4), 4)
        m.maybe_wait()
        m.load(4)
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("lm-resiliency:")]
    assert len(lines) == 2, lines
    assert "load_fallback() was used (fallback on ranks [0])" in lines[0]
    assert "recovered step 4 (own memory on ranks [0]) in " in lines[1]

"""``lm-resiliency clean``: stale runs' memory slots go, live ones stay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.cli.main import main
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.memory import MemoryFolder
from lm_resiliency.memory.scan import scan_memory
from lm_resiliency.persistence import namespace as ns


def _crashed_run(run_id: str, tmp: Path) -> None:
    cfg = InMemoryCkptConfig(
        run_id=run_id, disk_folder=str(tmp / "disk"), disk_flush_interval=10, signal_flush=False
    )
    m = InMemoryCheckpointManager(cfg)
    m.save({"w": torch.ones(1000), "step": 10}, 10)
    m.maybe_wait()
    m.wait_persisted()
    m.close(finished=False)  # left behind, as by a crash


def test_clean_removes_stale_runs_and_never_a_live_one(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _crashed_run("old", tmp_path)
    live = MemoryFolder(_isolated_memory_folder, run_id="busy", topology="b" * 64, rank=0)
    try:
        runs = {r.name: r for r in scan_memory(_isolated_memory_folder).runs}
        old = runs[ns.run_dir("old")]
        assert not old.live and old.run_id == "old"
        assert [s.state for s in old.ranks[0].slots] == ["COMMITTED"]
        assert runs[ns.run_dir("busy")].live

        mem = str(_isolated_memory_folder)
        assert main(["clean", "--stale", "--memory-folder", mem, "--dry-run"]) == 0
        assert ns.run_dir("old") in {r.name for r in scan_memory(mem).runs}
        assert main(["clean", "--stale", "--memory-folder", mem]) == 0
        assert [r.name for r in scan_memory(mem).runs] == [ns.run_dir("busy")]
        assert main(["clean", "--run", "busy", "--memory-folder", mem]) == 1  # kept: live
        assert "a live process holds it" in capsys.readouterr().out
        assert live.path.is_dir()
    finally:
        live.close()


def test_clean_can_also_remove_a_runs_files(tmp_path: Path, _isolated_memory_folder) -> None:
    _crashed_run("gone", tmp_path)
    disk = tmp_path / "disk"
    assert list(disk.glob(f"{ns.run_dir('gone')}/*"))
    args = ["--memory-folder", str(_isolated_memory_folder), "--disk-folder", str(disk)]
    assert main(["clean", "--run", "gone", *args]) == 0
    assert not (disk / ns.run_dir("gone")).exists()
    assert scan_memory(_isolated_memory_folder).runs == []


def test_inspect_lists_memory_slots_next_to_files(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _crashed_run("shown", tmp_path)
    code = main(
        ["inspect", str(tmp_path / "disk"), "--memory-folder", str(_isolated_memory_folder)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "memory run" in out and "run_id='shown'" in out
    assert "own-0.slot    COMMITTED         10      0" in out
    assert "rank 0: no live process" in out


def test_inspect_shows_each_generations_trust_and_why(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = InMemoryCkptConfig(
        run_id="trust", disk_folder=str(tmp_path / "disk"), interval=10, disk_flush_interval=10,
        signal_flush=False,
    )  # fmt: skip
    m = InMemoryCheckpointManager(cfg)
    for step in (10, 20):
        m.save({"w": torch.full((100,), float(step)), "step": step}, step)
        m.maybe_wait()
    m.wait_persisted()
    m.trust.mark_verified(10)
    m.trust.reject(20, reason="SCOUT at step 20: group [0, 1] inconclusive")
    m.trust.require_verified_recovery(20, reason="SDC at step 20")
    m.wait_persisted()
    m.close(finished=False)
    assert (
        main(["inspect", str(tmp_path / "disk"), "--memory-folder", str(_isolated_memory_folder)])
        == 0
    )
    out = capsys.readouterr().out
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.strip().startswith("step ")}
    assert "recovery_verified" in lines["10"]
    assert "rejected" in lines["20"] and "inconclusive" in lines["20"]
    assert "recover in verified mode (SCOUT saw SDC at step 20" in out

"""``lm-resiliency demo`` (what ``make demo`` runs) does what the README promises.

Runs the real command as a subprocess with small settings: a 2-worker torchrun
job loses rank 1 after step 8, restarts, recovers through GEMINI and finishes;
a fault-free job of the same seed runs, and the command reports that both end
bit-identical and exits 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_TIMEOUT_S = 400


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lm_resiliency.cli.main", "demo", *args],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


def test_demo_recovers_and_reports_a_bit_identical_result(tmp_path: Path) -> None:
    disk = tmp_path / "gemini"
    out = _demo("--world-size", "2", "--steps", "12", "--interval", "3", "--flush-interval", "6",
                "--fault-step", "8", "--fault-rank", "1", "--disk-folder", str(disk))  # fmt: skip
    text = out.stdout
    assert out.returncode == 0, f"{text}\n{out.stderr}"
    assert "** rank 1 SIGKILLed after step 8 **" in text
    assert "failure: rank 1 SIGKILLed after step 8" in text
    # Captures at 3 and 6: step 6 is the newest every rank can load, and every rank's
    # memory slot of it outlived its process (the survivors exited on the error).
    assert "recovery: all ranks agreed on step 6" in text
    for rank in (0, 1):
        assert f"  rank {rank}: own memory (its memory slot, re-attached by the restarted" in text
    assert "lost steps: 2 (fault after step 8, resumed from 6)" in text
    assert re.search(r"^recovery time: \d+\.\d+ s from the kill", text, re.M), text
    for phase in ("detection", "restart", "startup", "agreement", "load"):
        assert re.search(rf"^  {phase} +\d+\.\d+ s  ", text, re.M), text
    assert (
        "check: final parameters and optimizer state bit-identical to the fault-free run: True"
        in text
    )
    assert text.rstrip().splitlines()[-1].startswith("PASS in ")
    # The chosen folder holds the run's node-local files (run/topology namespaces): the
    # multiples of --flush-interval.
    steps = {p.parent.name for p in disk.glob("run-*/topo-*/step-*/rank-0.safetensors")}
    assert steps == {"step-6", "step-12"}


def test_demo_rejects_a_fault_before_the_first_capture() -> None:
    out = _demo("--steps", "12", "--interval", "5", "--fault-step", "3")
    assert out.returncode == 2
    assert "--fault-step=3 must come after the first capture (--interval=5)" in out.stderr

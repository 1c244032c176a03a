"""The MTGS trainer commands as documented: exit codes and what they print.

Each launch starts torchrun's elastic agent and two Gloo ranks (a few seconds).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LM_RESILIENCY_FAULTS", None)
    return subprocess.run(
        args, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.mark.slow
def test_baseline_command_trains_and_reports_no_recovery(tmp_path: Path) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        "--mode",
        "baseline",
        "--steps",
        "5",
        "--log-dir",
        str(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    assert "[train] committed steps=5 aborts=0 retries=0 rollbacks=0" in p.stdout
    assert "[train] ETTR n/a (no recovery)" in p.stdout
    assert "tokens/s=" in p.stdout
    assert (tmp_path / "result-rank1.json").exists()


@pytest.mark.slow
def test_forced_abort_command_prints_the_abort_retry_and_ettr(tmp_path: Path) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        "--mode",
        "mtgs",
        "--steps",
        "5",
        "--mtgs-force-abort-step",
        "2",
        "--log-dir",
        str(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    assert "[mtgs] step 2/5: attempt 1 aborted (vote phase: rank 0: forced; rank 1: forced)" in (
        p.stdout
    )
    assert "-> retried, committed on attempt 2" in p.stdout
    assert "[train] committed steps=5 aborts=1 retries=1 rollbacks=0" in p.stdout
    assert "[train] ETTR median=" in p.stdout and "(n=1)" in p.stdout
    header = (tmp_path / "ettr-rank0.csv").read_text().splitlines()[0]
    assert header.startswith("kind,step,attempt,rank")
    assert '"event": "mtgs.abort"' in (tmp_path / "events-rank1.jsonl").read_text()


@pytest.mark.slow
def test_cli_train_with_injected_update_fault_and_ablations_rolls_back(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("lm-resiliency")
    p = _run(
        str(exe),
        "train",
        "--steps",
        "3",
        "--faults",
        "optimizer_exception@1:2",
        "--mtgs-disable-hook",
        "--log-dir",
        str(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    assert "attempt 1 rolled back (commit phase: rank 1: step_exception)" in p.stdout
    assert "rollbacks=1" in p.stdout


@pytest.mark.slow
def test_a_local_repair_without_2pc_is_counted_in_the_summary(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("lm-resiliency")
    p = _run(
        str(exe),
        "train",
        "--steps",
        "3",
        "--faults",
        "optimizer_exception@0:2",
        "--mtgs-disable-2pc",
        "--log-dir",
        str(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    # Rank 0 redid its update from its shadow: no abort, no rollback, one local repair.
    assert "aborts=0 retries=0 rollbacks=0 local_repairs=1 (rank 0: 1)" in p.stdout, p.stdout
    assert "[train] ETTR median=" in p.stdout and "(n=1)" in p.stdout


def test_invalid_combinations_exit_2_with_the_reason() -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        "--mode",
        "baseline",
        "--mtgs-force-abort-step",
        "2",
        timeout_s=60,
    )
    assert p.returncode == 2
    assert "the --mtgs-* options need --mode mtgs" in p.stderr
    p = _run(sys.executable, "-m", "mtgs.trainer", "--faults", "nan_grad@5:1", timeout_s=60)
    assert p.returncode == 2
    assert "fault nan_grad@5:1 names rank 5 but --nproc=2" in p.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is not None, reason="transformers is installed"
)
def test_distilbert_without_transformers_says_how_to_install_it() -> None:
    p = _run(sys.executable, "-m", "mtgs.trainer", "--model", "distilbert", timeout_s=60)
    assert p.returncode == 2
    assert "--model distilbert needs the 'transformers' package" in p.stderr
    assert "pip install 'lm-resiliency[hf]'" in p.stderr

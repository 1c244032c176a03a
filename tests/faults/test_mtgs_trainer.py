"""The MTGS trainer commands as documented: exit codes and what they print.

Each launch starts torchrun's elastic agent and two Gloo ranks (a few seconds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _run(
    *args: str, timeout_s: float = 240, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
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


def test_distilbert_without_transformers_says_how_to_install_it() -> None:
    # transformers is hidden from this one process (sys.modules[name] = None makes both
    # find_spec and import fail), so the check runs whether or not it is installed.
    code = (
        "import sys; sys.modules['transformers'] = None; from mtgs.trainer import main; "
        "sys.exit(main(['--model', 'distilbert']))"
    )
    p = _run(sys.executable, "-c", code, timeout_s=60)
    assert p.returncode == 2
    assert "--model distilbert needs the 'transformers' package" in p.stderr
    assert "pip install 'lm-resiliency[hf]'" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the hf extra (transformers)"
)
def test_distilbert_trains_and_retries_an_injected_nan_gradient(tmp_path: Path) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        "--model",
        "distilbert",
        *("--layers", "1", "--width", "48", "--vocab", "128", "--seq-len", "16"),
        *("--batch-size", "2", "--steps", "2", "--faults", "nan_grad@1:2"),
        "--log-dir",
        str(tmp_path),
    )
    assert p.returncode == 0, p.stderr
    assert "[train] mode=mtgs model=distilbert" in p.stdout
    assert "[mtgs] step 2/2: attempt 1 aborted (vote phase: rank 1: nonfinite_grad)" in p.stdout
    assert "[train] committed steps=2 aborts=1 retries=1 rollbacks=0" in p.stdout


@pytest.mark.slow
def test_without_the_shadow_a_vote_abort_retries_but_a_failed_update_ends_the_run(
    tmp_path: Path,
) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        *("--steps", "3", "--mtgs-disable-shadow", "--mtgs-trace"),
        *("--faults", "nan_grad@1:2,optimizer_exception@0:3", "--log-dir", str(tmp_path)),
    )
    assert p.returncode == 1
    assert "[mtgs] step 2/3: attempt 1 aborted (vote phase: rank 1: nonfinite_grad)" in p.stdout
    for rank in range(2):
        assert (
            f"[train] rank {rank} failed: StepAborted: step 3: the update failed (rank 0: "
            "step_exception) and there is no shadow to roll back (MTGSConfig(shadow=False))"
        ) in p.stderr
        # the failed run keeps its trace: step 3's commit is the last event
        doc = json.loads((tmp_path / f"trace-rank{rank}.json").read_text())
        last = [e for e in doc["traceEvents"] if e["ph"] == "X"][-1]
        assert (last["name"], last["args"]["step"]) == ("commit", 3)


@pytest.mark.slow
def test_without_2pc_and_shadow_a_failed_update_cannot_be_repaired(tmp_path: Path) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        *("--steps", "2", "--mtgs-disable-2pc", "--mtgs-disable-shadow"),
        *("--faults", "optimizer_exception@1:2", "--log-dir", str(tmp_path)),
    )
    assert p.returncode == 1
    assert (
        "[train] rank 1 failed: StepAborted: step 2: the update failed on rank 1 (step_exception) "
        "after every rank voted to commit; without two_phase_commit and a shadow this rank "
        "cannot repair it"
    ) in p.stderr


@pytest.mark.slow
def test_without_the_hook_a_backward_exception_is_completed_and_retried(tmp_path: Path) -> None:
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        *("--steps", "3", "--mtgs-disable-hook", "--faults", "backward_exception@1:2"),
        *("--log-dir", str(tmp_path)),
    )
    assert p.returncode == 0, p.stderr
    assert "[mtgs] step 2/3: attempt 1 aborted (vote phase: rank 1: backward_exception)" in (
        p.stdout
    )
    assert "[train] committed steps=3 aborts=1 retries=1 rollbacks=0" in p.stdout
    events = (tmp_path / "events-rank1.jsonl").read_text().splitlines()
    (counts,) = [json.loads(x) for x in events if '"train.collectives"' in x]
    # no MTGS hook: DDP's own all-reduce reduced the buckets; rank 1 completed its share
    assert counts["bucket_allreduces"] == 0 and counts["explicit_votes"] == 4
    assert counts["fallback_allreduces"] > 0


# Imported by every process of the run (sitecustomize): no automatic collection, and at
# exit, before the interpreter finalizes, each worker writes which Gloo threads still run.
_EXIT_OBSERVER = """
import atexit, gc, os, sys
gc.disable()
def _record():
    if "_train_worker" not in " ".join(sys.argv):
        return
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    path = os.path.join(os.environ["EXIT_OBSERVER_DIR"], f"gloo-threads-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(",".join(sorted(n for n in names if "gloo" in n)))
atexit.register(_record)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_workers_stop_the_gloo_threads_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    # Without the cyclic GC, the first DDP model of a process stays in torch's import garbage
    # (and, before the fix, in MTGS's abort traceback): its reducer keeps the group, and a
    # Gloo thread alive in interpreter shutdown may abort the process (std::terminate).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_EXIT_OBSERVER)
    observed = tmp_path / "observed"
    observed.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    p = _run(
        sys.executable,
        "-m",
        "mtgs.trainer",
        *("--steps", "3", "--mtgs-disable-hook", "--faults", "backward_exception@1:2"),
        *("--log-dir", str(tmp_path / "logs")),
        env_extra={"PYTHONPATH": path, "EXIT_OBSERVER_DIR": str(observed)},
    )
    assert p.returncode == 0, p.stderr
    assert "[train] committed steps=3 aborts=1 retries=1 rollbacks=0" in p.stdout
    left = sorted(f.read_text() for f in observed.glob("gloo-threads-*.txt"))
    assert left == ["", ""], f"Gloo threads still running at a worker's exit: {left}"

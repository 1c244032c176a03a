"""What a newcomer tripped over on a fresh clone (#12, the list at its end), each fixed."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lm_resiliency.capture import Layout
from lm_resiliency.cli import demo
from lm_resiliency.cli.main import build_parser, main
from lm_resiliency.persistence import ShardStore
from lm_resiliency.state import encode_state
from lm_resiliency.testing.torchrun import CompletedRun, WorkerLog

torch.set_num_threads(1)
_ROOT = Path(__file__).resolve().parents[2]


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    env.pop("LM_RESILIENCY_FAULTS", None)
    return env


# -- demo -------------------------------------------------------------------------------


@pytest.mark.parametrize(("steps", "fault"), [(20, 16), (40, 33), (12, 9)])
def test_demo_fault_step_defaults_from_steps(steps: int, fault: int) -> None:
    args = build_parser().parse_args(["demo", "--world-size", "2", "--steps", str(steps)])
    demo._check(args)  # the README's own example used to exit 2 here
    assert args.fault_step == fault
    assert args.interval <= args.fault_step < args.steps


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_demo_rejects_a_timeout_that_is_not_positive(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--timeout-s", value]) == 2
    assert (
        f"--timeout-s={float(value)}: use a positive number of seconds" in capsys.readouterr().err
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_stopped_by_sigterm_stops_its_jobs_and_removes_its_folder(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm_resiliency.cli.main", "demo", "--world-size", "2",
         "--steps", "200", "--interval", "5", "--timeout-s", "180"],
        cwd=_ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("] step " in ln for ln in lines) and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.2)
    (work,) = tmp_path.glob("lmr-demo-*")  # training runs: the rendezvous on port 0 worked
    assert (work / "gemini").is_dir() or (work / "faulty").is_dir()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    reader.join(timeout=10)
    text = "".join(lines)
    assert f"files: {work} (events, torchrun logs, GEMINI's files) is removed at the end" in text
    assert f"removed {work}" in text and "STOPPED by SIGTERM" in text
    assert not work.exists()
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(work).encode() in cmdline.read_bytes():
                leftovers.append(cmdline.parent.name)
        except OSError:
            continue
    assert leftovers == [], f"processes of the stopped demo still run: {leftovers}"


def test_torchrun_failure_summary_is_short_and_drops_cpp_frames() -> None:
    frames = "\n".join(f"frame #{i}: c10::foo() + 0x{i:x} (0x7f in libtorch.so)" for i in range(60))
    err = f"Traceback (most recent call last):\nRuntimeError: Connection reset\n{frames}\n"
    run = CompletedRun(
        returncode=1,
        stdout="",
        stderr="torch.distributed.elastic.multiprocessing.errors.ChildFailedError\n" + frames,
        attempts=2,
        workers=(WorkerLog(1, 0, "", err), WorkerLog(0, 0, "", "old attempt")),
        timed_out=False,
        command=("python", "-m", "torch.distributed.run"),
    )
    brief = run.brief()
    assert "frame #" not in brief and len(brief.splitlines()) <= 10, brief
    assert "RuntimeError: Connection reset" in brief and "old attempt" not in brief
    assert brief.startswith("torchrun exit status 1, 2 attempt(s)")


# -- inspect ----------------------------------------------------------------------------


def _folder(root: Path, *, integrity: bool) -> Path:
    store = ShardStore(root, run_id="n", topology="b" * 64, rank=0, verify_integrity=integrity)
    tensor = torch.ones(64)
    layout = Layout.from_tensors([tensor], ["w"])
    for step in range(1, 4):
        store.write(owner_rank=0, step=step, layout=layout, arena=tensor.view(torch.uint8),
                    state_document=encode_state({"w": tensor}).document)  # fmt: skip
    store.close()
    return root


def test_inspect_verify_without_checksums_says_nothing_was_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, integrity=False)
    assert main(["inspect", str(folder)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--verify", str(folder)]) == 3
    out = capsys.readouterr().out
    assert out.count("ok, NOT verified (no checksums)") == 2  # keep_generations=2
    assert "NOT verified: 2 shard(s) have no checksums" in out


def test_inspect_into_a_closed_pipe_ends_without_a_traceback(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt", integrity=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm_resiliency.cli.main", "inspect", str(folder)],
        cwd=_ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head` that already exited: every write gets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# -- train and chunk-size ---------------------------------------------------------------


def test_train_errors_name_the_command_and_reject_a_fault_after_the_last_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--steps", "3", "--faults", "nan_grad@0:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lm-resiliency train: error: fault nan_grad@0:9 is at step 9, outside")
    assert "python -m mtgs.trainer" not in err


@pytest.mark.slow
def test_train_fails_on_a_nan_loss_and_cleans_its_temporary_folder(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtgs.trainer", "--steps", "3", "--nproc", "1", *args],
            cwd=_ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=240,
            check=False,
        )  # fmt: skip

    nan = run("--mode", "baseline", "--faults", "nan_grad@0:1")
    assert nan.returncode == 1, nan.stdout + nan.stderr
    assert "[train] OK" not in nan.stdout
    assert "rank 0: the loss is not finite from step 2 on (baseline has no transaction" in (
        nan.stderr
    )
    (kept,) = tmp_path.glob("mtgs-train-*")  # a failed run keeps its events for debugging
    assert f"events and ETTR kept in {kept}" in nan.stderr
    ok = run("--mode", "mtgs")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "(ETTR: effective time to recovery" in ok.stdout and "[train] OK" in ok.stdout
    assert list(tmp_path.glob("mtgs-train-*")) == [kept]  # the successful run left nothing
    assert math.isfinite(float(ok.stdout.split("final loss=")[1].split()[0]))


def test_chunk_size_and_train_flags_have_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["chunk-size", "--help"])
    out = capsys.readouterr().out
    for text in ("gigabits per second", "one layer's forward/backward", "all-gather (the",
                 "share of the slack"):  # fmt: skip
        assert text in out, out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "retries of an aborted step" in capsys.readouterr().out

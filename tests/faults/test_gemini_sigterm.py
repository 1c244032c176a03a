"""SIGTERM during training: the manager flushes the newest complete capture, then chains.

Also: a SIGTERM that arrives while the main thread is already flushing (from an
exception handler) neither deadlocks nor tears that flush.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    import torch
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager

    folder, marker, chain = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if chain == "previous":
        def previous(signum, frame):
            print("previous handler ran", flush=True)
            sys.exit(42)
        signal.signal(signal.SIGTERM, previous)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = InMemoryCkptConfig(interval=2, disk_folder=folder, disk_flush_interval=0,
                             run_id="sigterm-test")
    manager = InMemoryCheckpointManager(cfg)
    step = 0
    while True:
        step += 1
        model(torch.randn(4, 16)).sum().backward()
        manager.maybe_wait()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            manager.save({"model": model.state_dict(), "step": step}, step)
            manager.maybe_wait()
            if step == 6:
                torch.save(model.state_dict(), marker.with_suffix(".expected"))
                marker.write_text("ready")
        time.sleep(0.05 if step >= 6 else 0)
        if step >= 6:
            while True:
                time.sleep(0.1)  # training stalls here; SIGTERM arrives
    """
)


def _run_child(tmp_path: Path, chain: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker = tmp_path / "ready.txt"
    folder = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(marker), chain],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "child never reached step 6"
        time.sleep(0.05)
    # Periodic flush is off: only the signal handler can have written files.
    assert not any(folder.rglob("*.safetensors"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder


def _recover(folder: Path, marker_dir: Path) -> None:
    # memory_folder=None: the child's memory slots (still on /dev/shm) are not consulted, so
    # the step must come from what the signal flush wrote.
    cfg = InMemoryCkptConfig(
        disk_folder=folder, run_id="sigterm-test", signal_flush=False, memory_folder=None
    )
    with InMemoryCheckpointManager(cfg) as m:
        assert m.find_latest() == 6
        state = m.load(6)
        assert m.last_restore.sources == ["own disk"]
    # the expected values were written with torch.save by the child (weights only)
    expected = torch.load(marker_dir / "ready.expected", weights_only=True)
    assert state["step"] == 6
    for k, v in expected.items():
        assert torch.equal(state["model"][k], v)


def test_sigterm_flushes_the_newest_capture_and_dies_by_the_signal(tmp_path) -> None:
    result, folder = _run_child(tmp_path, "default")
    assert result.returncode == -signal.SIGTERM, result.stderr
    _recover(folder, tmp_path)


def test_sigterm_flush_chains_to_the_previous_handler(tmp_path) -> None:
    result, folder = _run_child(tmp_path, "previous")
    assert result.returncode == 42, result.stderr
    assert "previous handler ran" in result.stdout
    _recover(folder, tmp_path)


FLUSHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager

    folder = sys.argv[1]
    cfg = InMemoryCkptConfig(interval=1, disk_folder=folder, disk_flush_interval=0,
                             run_id="sigterm-during-flush", memory_folder=None,
                             signal_flush_deadline_s=60)
    manager = InMemoryCheckpointManager(cfg)
    manager.save({"w": torch.full((96 << 20,), 7.0), "step": 7}, 7)
    manager.maybe_wait()
    manager.wait_persisted()
    try:
        raise RuntimeError("Connection closed by peer")  # a survivor's collective error
    except RuntimeError:
        # the user's exception handler persists what it has; torchrun's SIGTERM lands
        # in the middle of that flush
        killer = threading.Timer(0.05, os.kill, args=(os.getpid(), signal.SIGTERM))
        killer.start()
        print("flushing", flush=True)
        manager.flush_newest()  # the deferred SIGTERM ends the process right after it
        print("flush returned", flush=True)  # not reached
    time.sleep(30)
    """
)


def test_sigterm_during_an_exception_handlers_flush_neither_deadlocks_nor_tears_it(
    tmp_path,
) -> None:
    script = tmp_path / "child.py"
    script.write_text(FLUSHING_CHILD)
    folder = tmp_path / "ckpt"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the exit status is asserted below
    )
    elapsed = time.monotonic() - t0
    assert done.returncode == -signal.SIGTERM, done.stderr
    # The interrupted flush ran to its end, then the signal took the default action.
    assert done.stdout.splitlines() == ["flushing"]
    assert elapsed < 30  # not the 60 s deadline: the handler did not wait on the flush
    assert not list(folder.rglob("*.tmp"))
    assert [p.name for p in folder.rglob("*.safetensors")] == ["rank-0.safetensors"]
    cfg = InMemoryCkptConfig(
        disk_folder=folder, run_id="sigterm-during-flush", memory_folder=None, signal_flush=False
    )
    with InMemoryCheckpointManager(cfg) as m:
        assert m.find_latest() == 7
        assert torch.equal(m.load(7)["w"], torch.full((96 << 20,), 7.0))


EXITING_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager

    cfg = InMemoryCkptConfig(interval=1, disk_folder=sys.argv[1], disk_flush_interval=0,
                             run_id="exit-flush", memory_folder=sys.argv[2] or None)
    manager = InMemoryCheckpointManager(cfg)
    for step in (3, 4):
        manager.save({"w": torch.full((1000,), float(step)), "step": step}, step)
        manager.maybe_wait()
    manager.wait_persisted()
    raise RuntimeError("Connection closed by peer")  # a survivor's collective error, uncaught
    """
)


def _exit_on_error(tmp_path: Path, memory: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_CHILD)
    folder = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(script), str(folder), memory],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and "Connection closed by peer" in done.stderr, done.stderr
    return done, folder


def test_an_uncaught_exception_persists_slots_that_live_in_process_memory(tmp_path) -> None:
    done, folder = _exit_on_error(tmp_path, "")
    assert "persisting the newest slots first" in done.stderr
    cfg = InMemoryCkptConfig(
        disk_folder=folder, run_id="exit-flush", memory_folder=None, signal_flush=False
    )
    with InMemoryCheckpointManager(cfg) as m:
        assert m.find_latest() == 4
        assert torch.equal(m.load(4)["w"], torch.full((1000,), 4.0))


def test_an_uncaught_exception_writes_nothing_when_the_slots_survive(tmp_path) -> None:
    done, folder = _exit_on_error(tmp_path, str(tmp_path / "shm"))
    assert "persisting" not in done.stderr
    assert not list(folder.rglob("*.safetensors"))  # memory outlives the process anyway

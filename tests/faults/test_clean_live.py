"""``lm-resiliency clean`` never removes what a live process holds, refuses a folder of the
wrong kind, and removes exactly the paths its dry run listed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lm_resiliency.cli.main import main
from lm_resiliency.persistence import namespace as ns

RUN_ID = "live-job"

# A real worker: captures and persists steps, then keeps its locks until killed.
_WORKER = textwrap.dedent(
    """
    import sys, torch
    from lm_resiliency import InMemoryCkptConfig
    from lm_resiliency.experimental import InMemoryCheckpointManager
    memory = None if sys.argv[2] == "none" else sys.argv[2]
    cfg = InMemoryCkptConfig(run_id=sys.argv[1], memory_folder=memory, disk_folder=sys.argv[3],
                             interval=1, disk_flush_interval=1, signal_flush=False)
    m = InMemoryCheckpointManager(cfg)
    for step in (1, 2, 3):
        m.save({"w": torch.full((256,), float(step)), "step": step}, step)
        m.maybe_wait()
    m.wait_persisted()
    if len(sys.argv) > 4:  # also hold a lock file of the disk namespace
        import fcntl, os
        fd = os.open(sys.argv[4], os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def _start(memory: str, disk: Path, *lock: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, RUN_ID, memory, str(disk), *lock],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", f"worker did not start (exit {proc.poll()})"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)  # a crash: the kernel drops its locks
    proc.wait(timeout=60)


def _tree(*roots: Path) -> set[str]:
    return {str(p) for root in roots for p in root.rglob("*")}


def _listed(out: str, verb: str) -> set[str]:
    return {ln[len(verb) + 1 :] for ln in out.splitlines() if ln.startswith(f"{verb} /")}


@pytest.mark.timeout(180)
def test_a_live_job_keeps_memory_and_disk_then_clean_removes_exactly_what_it_listed(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    mem = str(_isolated_memory_folder)
    args = ["clean", "--run", RUN_ID, "--memory-folder", mem, "--disk-folder", str(disk)]
    proc = _start(mem, disk)
    try:
        before = _tree(_isolated_memory_folder, disk)
        assert any(p.endswith(".safetensors") for p in before)
        assert any(p.endswith(".slot") for p in before)
        for dry in ([], ["--dry-run"]):
            assert main([*args, *dry]) == 1
            out = capsys.readouterr().out
            assert "a live process holds it" in out
            assert f"kept {disk / ns.run_dir(RUN_ID)}: run {RUN_ID!r} is live" in out
            assert _tree(_isolated_memory_folder, disk) == before  # nothing went
    finally:
        _kill(proc)
    assert main([*args, "--dry-run"]) == 0
    planned = _listed(capsys.readouterr().out, "would remove")
    assert _tree(_isolated_memory_folder, disk) == before
    assert main(args) == 0
    removed = _listed(capsys.readouterr().out, "removed")
    gone = before - _tree(_isolated_memory_folder, disk)
    assert planned == removed == gone
    assert gone == {p for p in before if ns.run_dir(RUN_ID) in p}


@pytest.mark.timeout(180)
def test_a_held_lock_of_the_disk_namespace_keeps_the_run_files(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    lock = disk / ns.run_dir(RUN_ID) / "lock"
    args = ["clean", "--run", RUN_ID, "--disk-folder", str(disk)]
    args += ["--memory-folder", str(_isolated_memory_folder)]
    proc = _start("none", disk, str(lock))  # no memory tier: only the disk lock says live
    try:
        before = _tree(disk)
        assert main(args) == 1
        assert f"a live process holds its lock {lock}" in capsys.readouterr().out
        assert _tree(disk) == before
    finally:
        _kill(proc)
    assert main(args) == 0
    assert not (disk / ns.run_dir(RUN_ID)).exists()


@pytest.mark.timeout(180)
def test_a_folder_of_the_wrong_kind_is_refused_whole(
    tmp_path: Path, _isolated_memory_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    mem = str(_isolated_memory_folder)
    _kill(_start(mem, disk))  # a crashed job: nothing live, both tiers left behind
    before = _tree(_isolated_memory_folder, disk)
    for argv in (
        ["clean", "--stale", "--memory-folder", str(disk)],
        ["clean", "--stale", "--memory-folder", str(disk), "--dry-run"],
        ["clean", "--run", RUN_ID, "--memory-folder", str(disk)],
        ["clean", "--run", RUN_ID, "--memory-folder", str(tmp_path / "x"), "--disk-folder", mem],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "nothing was removed" in err and "not" in err, err
        assert _tree(_isolated_memory_folder, disk) == before
    assert "is not a memory folder: it holds" in _run_err(
        ["clean", "--stale", "--memory-folder", str(disk)], capsys
    )
    assert "is not the disk checkpoint folder of run 'live-job'" in _run_err(
        ["clean", "--run", RUN_ID, "--memory-folder", str(tmp_path / "x"), "--disk-folder", mem],
        capsys,
    )


def _run_err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    main(argv)
    return capsys.readouterr().err

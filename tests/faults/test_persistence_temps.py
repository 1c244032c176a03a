"""Temp files: a writer SIGKILLed mid-write leaves a temp its scope reaps; other scopes' survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from lm_resiliency._tempnames import TempName, TempScope
from lm_resiliency.capture import Layout
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence.format import KILL_MID_WRITE

torch.set_num_threads(1)

_WRITER = textwrap.dedent(
    """
    import sys, torch
    from lm_resiliency.capture import Layout
    from lm_resiliency.persistence import ShardStore
    layout = Layout.from_tensors([torch.empty(1 << 16, dtype=torch.int32)], ["w"])
    arena = torch.full((layout.total_bytes,), 7, dtype=torch.uint8)
    store = ShardStore(sys.argv[1], run_id="r", topology="t", rank=0, verify_integrity=True,
                       chunk_bytes=4096)
    store.write(owner_rank=0, step=5, layout=layout, arena=arena, state_document={})
    print("finished", flush=True)
    """
)


def _kill_writer_mid_write(root: Path) -> int:
    env = {**os.environ, "LM_RESILIENCY_TEST_KILL": KILL_MID_WRITE}
    child = subprocess.run(
        [sys.executable, "-c", _WRITER, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "finished" not in child.stdout
    return child.returncode


def _store(root: Path) -> ShardStore:
    return ShardStore(root, run_id="r", topology="t", rank=0, verify_integrity=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _plant_foreign(step_dir: Path, pid: int) -> list[Path]:
    here = TempScope.current()
    other_boot = "0" * 32 if here.boot_id != "0" * 32 else "1" * 32
    names = [
        f".rank-0.safetensors.lmr-{other_boot}-{here.pid_namespace}-{pid}-0.tmp",
        f".rank-0.safetensors.lmr-{here.boot_id}-{here.pid_namespace + 1}-{pid}-0.tmp",
    ]
    paths = [step_dir / n for n in names]
    for p in paths:
        p.write_bytes(b"someone else's half-written shard")
    return paths


def test_killed_writer_leaves_a_temp_that_the_next_writer_of_its_scope_reaps(
    tmp_path: Path,
) -> None:
    _kill_writer_mid_write(tmp_path)
    store = _store(tmp_path)
    step_dir = store.topology_path / "step-5"
    temps = [p for p in step_dir.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1
    left = TempName.parse(temps[0].name)
    assert left is not None and left.target == "rank-0.safetensors"
    assert left.scope == TempScope.current() and left.pid != os.getpid()
    assert 0 < temps[0].stat().st_size < (1 << 18)  # torn: only part of the data
    assert store.steps(0) == []  # the torn write never became visible
    foreign = _plant_foreign(step_dir, _dead_pid())

    layout = Layout.from_tensors([torch.empty(16, dtype=torch.int32)], ["w"])
    arena = torch.full((layout.total_bytes,), 3, dtype=torch.uint8)
    store.write(owner_rank=0, step=5, layout=layout, arena=arena, state_document={})

    assert not temps[0].exists()
    assert all(p.exists() for p in foreign)  # other boot / PID namespace: never touched
    assert store.steps(0) == [5]
    assert torch.equal(store.read(owner_rank=0, step=5).arena, arena)


def test_reap_stale_temps_spares_live_writers_and_other_scopes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    here = TempScope.current()
    step_dir = store.topology_path / "step-9"
    step_dir.mkdir(mode=0o700)
    dead = _dead_pid()
    stale = step_dir / f".rank-2.safetensors.lmr-{here.token}-{dead}-4.tmp"
    live_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = step_dir / f".rank-3.safetensors.lmr-{here.token}-{live_child.pid}-0.tmp"
        mine = step_dir / f".rank-4.safetensors.lmr-{here.token}-{os.getpid()}-99.tmp"
        sidecar_temp = store.topology_path / f".status-rank-0.json.lmr-{here.token}-{dead}-1.tmp"
        unrelated = step_dir / "notes.txt"
        for p in (stale, live, mine, sidecar_temp, unrelated):
            p.write_bytes(b"x")
        foreign = _plant_foreign(step_dir, dead)
        assert store.reap_stale_temps() == 2
        assert not stale.exists() and not sidecar_temp.exists()
        assert live.exists() and mine.exists() and unrelated.exists()
        assert all(p.exists() for p in foreign)
    finally:
        live_child.kill()
        live_child.wait(timeout=60)

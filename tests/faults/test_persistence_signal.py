"""SIGTERM/SIGINT in a real child process: flush the newest complete step, then chain."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.persistence import ShardStore, install_flush_on_signal

torch.set_num_threads(1)

# A "training loop": every step fills a fresh arena; only a complete one is
# published to `newest`, which is what the flush persists.
_CHILD = textwrap.dedent(
    """
    import signal, sys, time, torch
    from lm_resiliency.capture import Layout
    from lm_resiliency.persistence import ShardStore, install_flush_on_signal
    torch.set_num_threads(1)
    root, mode = sys.argv[1], sys.argv[2]
    store = ShardStore(root, run_id="sig", topology="t", rank=0, verify_integrity=True)
    layout = Layout.from_tensors([torch.empty(4096, dtype=torch.float32)], ["w"])
    newest = {}

    def flush():
        if mode == "hang":
            time.sleep(600)
        step, arena = newest["slot"]
        store.write(owner_rank=0, step=step, layout=layout, arena=arena,
                    state_document={"step": step})
        print(f"flushed {step}", flush=True)

    if mode == "chain":
        def previous(signum, frame):
            print("previous handler", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, previous)
    install_flush_on_signal(flush, deadline_s=1.0 if mode == "hang" else 60.0)
    step = 0
    while True:
        step += 1
        arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
        layout.views(arena)[0].fill_(float(step))
        newest["slot"] = (step, arena)
        if step == 3:
            print("ready", flush=True)
        time.sleep(0.01)
    """
)


def _run(tmp_path: Path, mode: str, signum: int) -> tuple[int, str, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signum)
    out, err = child.communicate(timeout=120)
    return child.returncode, out, err


def _check_flushed(tmp_path: Path, out: str) -> int:
    flushed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("flushed")]
    assert len(flushed) == 1
    store = ShardStore(tmp_path, run_id="sig", topology="t", rank=0, verify_integrity=True)
    assert store.steps(0) == flushed
    loaded = store.read(owner_rank=0, step=flushed[0])
    assert loaded.state_document == {"step": flushed[0]}
    w = loaded.layout.views(loaded.arena)[0]
    assert torch.equal(w, torch.full((4096,), float(flushed[0])))
    return flushed[0]


def test_sigterm_flushes_then_dies_by_sigterm(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, "default", signal.SIGTERM)
    assert code == -signal.SIGTERM, err
    assert _check_flushed(tmp_path, out) >= 3


def test_sigterm_flushes_then_chains_to_the_previous_handler(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, "chain", signal.SIGTERM)
    assert code == 7, err
    assert "previous handler" in out
    _check_flushed(tmp_path, out)


def test_sigint_flushes_then_raises_keyboard_interrupt(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, "default", signal.SIGINT)
    # Python exits from an uncaught KeyboardInterrupt by re-raising SIGINT.
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err
    _check_flushed(tmp_path, out)


def test_flush_past_its_deadline_still_ends_the_process(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, "hang", signal.SIGTERM)
    assert code == -signal.SIGTERM
    assert "flushed" not in out and "did not finish within 1.0s" in err
    store = ShardStore(tmp_path, run_id="sig", topology="t", rank=0, verify_integrity=True)
    assert store.steps(0) == []


def test_non_positive_deadline_is_refused() -> None:
    with pytest.raises(ConfigError, match="deadline_s=0 must be > 0"):
        install_flush_on_signal(lambda: None, deadline_s=0)


def test_uninstall_restores_the_previous_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    handle = install_flush_on_signal(lambda: None, deadline_s=5, signals=(signal.SIGTERM,))
    assert signal.getsignal(signal.SIGTERM) != before
    handle.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before

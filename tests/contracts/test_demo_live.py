"""``lm-resiliency demo --live``: the real command, 4 replica groups, replica 1 SIGKILLed.

The summary must say when the survivors committed again, that no sample was lost and that the
replicas' digests were identical after every commit (all from ``check_run`` over the event
logs); and the demo must leave no process behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _live_pids() -> set[int]:
    """Processes of this user running the demo's training script."""
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if b"lm_resiliency.demo.live_kill" in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
            out.add(int(proc.name))
    return out


@pytest.mark.timeout(900)
def test_demo_live_survivors_go_on_and_lose_no_sample() -> None:
    before = _live_pids()
    done = subprocess.run(
        [sys.executable, "-m", "lm_resiliency.cli.main", "demo", "--live"],
        check=False,
        capture_output=True,
        text=True,
        timeout=840,
        env=dict(os.environ),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(
        r"^first committed step of the survivors \d+\.\d\d s after the kill", out, re.M
    ), out
    assert re.search(r"^samples lost: 0 ", out, re.M), out
    assert "replica digests identical after every commit: yes" in out, out
    assert re.search(r"^full world again", out, re.M), out
    assert "survivors [0, 2, 3] kept their processes: yes" in out, out
    assert not _live_pids() - before, "the demo left a training process running"

"""A replica SIGSTOPped, evicted by its lease, then SIGCONTed: fenced, exits 76, registers again.

4 replica groups of one process each under the real launcher train the demo model in the plain
MTGS loop (``lm_resiliency.demo.live_worker``, no exception handling). Once every replica has
committed step 3, the test SIGSTOPs replica 1's worker. A stopped process keeps its sockets
open (no EOF, no ``Connection reset``), so only its lease can catch it: the survivors must
evict it when the lease expires and go on (``check_run``'s invariants for the survivors). Once
the survivors committed a step without it, the test SIGCONTs it: it is fenced (it commits
nothing more and the survivors' membership never changes again), its next call raises
``Evicted``, the front door exits it with code 76 and one line, its torchrun restarts it and
the new process registers as a joiner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lm_resiliency._proctree import alive as _alive
from lm_resiliency.frontdoor.live_exit import EXIT_EVICTED
from lm_resiliency.live.runcheck import check_run, read_events

pytestmark = pytest.mark.slow

_STEPS = 14
_STOPPED = 1
_B, _SAMPLES, _SEED = 16, 512, 0
# The lease is what catches the stop, so it is short enough to do so while the run goes on,
# and long enough that a healthy worker on this loaded machine never misses it.
_LEASE = ["--heartbeat-s", "0.2", "--lease-s", "4", "--stale-s", "2"]
# A stand-in for real compute (as the demo's): the bare demo step takes ~50 ms, so the replicas
# could finish the 14 steps between two of the test's polls after step 3.
_TIMING = [*_LEASE, "--reform-timeout-s", "60", "--coordinator-timeout-s", "30",
           "--step-sleep-s", "0.3"]  # fmt: skip
_COORD = ["--coordinator-arg=--heartbeat-s=0.2", "--coordinator-arg=--lease-s=4",
          "--coordinator-arg=--stale-s=2"]  # fmt: skip
_WORKER = ["-m", "lm_resiliency.demo.live_worker"]


def _records(run_dir: Path, replica: int) -> list[dict[str, Any]]:
    path = run_dir / f"events-replica-{replica}-rank-0.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _commits(run_dir: Path, replica: int) -> list[dict[str, Any]]:
    return [r for r in _records(run_dir, replica) if r["event"] == "mtgs.commit"]


def _wait(proc: subprocess.Popen[bytes], log: Path, what: str, done: Any, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert proc.poll() is None, (
            f"launcher exited {proc.returncode} before {what}: " + (log.read_text()[-4000:])
        )
        assert time.monotonic() < deadline, (
            f"not within {limit_s:g} s: {what}\n" + (log.read_text()[-4000:])
        )
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_sigstop_evicted_by_lease_then_fenced(tmp_path: Path) -> None:
    env = dict(os.environ, LMR_LIVE_EVENTS=str(tmp_path))
    env.pop("LM_RESILIENCY_TEST_KILL", None)
    cmd = [sys.executable, "-m", "lm_resiliency.cli", "launch", "--replica-groups", "4",
           "--nproc-per-group", "1", "--term-grace-s", "10", *_COORD, "--", *_WORKER,
           "--steps", str(_STEPS), "--global-batch", str(_B), *_TIMING]  # fmt: skip
    log = tmp_path / "launcher.log"
    out = log.open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    survivors = [r for r in range(4) if r != _STOPPED]
    stopped_pid = 0
    try:
        _wait(proc, log, "every replica committed step 3",
              lambda: all(len(_commits(tmp_path, r)) >= 3 for r in range(4)), 600)  # fmt: skip
        stopped_pid = _commits(tmp_path, _STOPPED)[0]["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)
        t_stop = time.time()
        stopped_at = len(_commits(tmp_path, _STOPPED))

        def evicted() -> bool:
            return all(
                any(c["members"] == survivors for c in _commits(tmp_path, r)) for r in survivors
            )

        _wait(proc, log, "the survivors committed a step without the stopped replica", evicted,
              300)  # fmt: skip
        os.kill(stopped_pid, signal.SIGCONT)

        def rejoined() -> bool:
            return any(
                r["event"] == "live.joining" and r["pid"] != stopped_pid
                for r in _records(tmp_path, _STOPPED)
            )

        _wait(proc, log, "the woken replica exited and its restart registered as a joiner",
              rejoined, 300)  # fmt: skip
        _wait(proc, log, "the survivors finished",
              lambda: all(_commits(tmp_path, r)[-1]["step"] == _STEPS for r in survivors),
              600)  # fmt: skip
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a joiner not yet admitted when the rest finished
        rc = proc.wait(timeout=120)
    finally:
        if stopped_pid and _alive(stopped_pid):
            os.kill(stopped_pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    text = log.read_text()
    assert rc in (0, 128 + signal.SIGTERM), text[-3000:]

    run = check_run(tmp_path, stream=(_SEED, _SAMPLES, _B))
    assert set(survivors) <= set(run.survivors), run.survivors  # + the healed restart, if admitted
    assert run.last_step == _STEPS
    # Evicted by the lease (a stopped process keeps its sockets: no EOF, no reset).
    changes = [c["change"] for c in _commits(tmp_path, survivors[0]) if "change" in c]
    assert len(changes) == 1, changes
    assert "lease expired" in changes[0]["cause"], changes[0]
    assert f"r{_STOPPED}g0" in changes[0]["cause"], changes[0]
    # Fenced: it committed nothing after the stop, and nothing it sent after waking changed the
    # survivors' membership: every later commit is under the eviction's epoch, or (once its
    # restarted incarnation was healed and admitted, §6) under an admission's epoch with the
    # full world.
    mine = [c for c in _commits(tmp_path, _STOPPED) if c["pid"] == stopped_pid]
    assert len(mine) <= stopped_at + 1, mine  # at most the step already confirmed at the stop
    evicted_at = min(
        c["step"] for c in _commits(tmp_path, survivors[0]) if c["members"] == survivors
    )
    for r in survivors:
        later = [c for c in _commits(tmp_path, r) if c["step"] >= evicted_at]
        for c in later:
            evicted_epoch = c["epoch"] == 1 and c["members"] == survivors
            admitted = c["epoch"] > 1 and c["members"] == list(range(4))
            assert evicted_epoch or admitted, later
    # It left through the front door with the exit code and the one line, and was restarted.
    lines = [ln for ln in text.splitlines() if "was evicted at epoch 1" in ln]
    assert len(lines) == 1, text[-4000:]
    assert f"pid {stopped_pid}" in lines[0] and f"code {EXIT_EVICTED}" in lines[0], lines[0]
    assert re.search(rf"exitcode\s*:\s*{EXIT_EVICTED}\b", text), text[-4000:]
    before_teardown = text.split("got signal")[0]  # torchrun's own trace of the SIGTERM after
    assert "Traceback" not in before_teardown, before_teardown[-4000:]
    pids = run.pids[_STOPPED]
    assert len(pids) == 2 and pids[0] == stopped_pid, pids
    t_detect = changes[0].get("t_detect")
    if t_detect is not None:
        print(f"\nSIGSTOP detected by the lease {t_detect - t_stop:.2f} s after the stop")
    first = min(c["ts_ns"] for c in _commits(tmp_path, survivors[0]) if c["step"] == evicted_at)
    print(f"first committed step of the survivors {first / 1e9 - t_stop:.2f} s after the stop")
    leftover = [p for ps in run.pids.values() for p in ps if _alive(p)]
    assert not leftover, f"workers outlived the launcher: {leftover}"
    assert read_events(tmp_path)

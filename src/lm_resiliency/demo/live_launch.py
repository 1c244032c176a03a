"""Start, follow and stop a live-membership run of the demo model (``demo --live``, the benchmark).

One ``lm-resiliency launch --replica-groups R --nproc-per-group 1`` of
:mod:`lm_resiliency.demo.live_kill` (the plain MTGS loop, a kill point armed in chosen
replicas), its event logs in ``run_dir`` (``LMR_LIVE_EVENTS``), its output in
``run_dir/launcher.log``. :func:`follow` waits until the survivors committed the last step and
every killed replica came back (committed the last step too when the heal admits it, else
registered as a joiner), then stops the launcher, which kills whatever of its tree is left.
A joiner still waiting when every member finished is told so by the coordinator and exits
0, so the launcher may also end by itself first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_resiliency._killpoints import KILL_ENV, LIVE_KILL_POINTS

from .live_kill import KILL_REPLICAS_ENV

__all__ = ["LiveJob", "LiveSpec", "follow", "start"]

_POLL_S = 0.25


@dataclass(frozen=True)
class LiveSpec:
    """What to run: the size, the steps and the kill (``kill_replicas=()``: none)."""

    replicas: int = 4
    steps: int = 40
    global_batch: int = 16
    seed: int = 0
    kill_point: str = "live.forward"
    kill_step: int = 8
    kill_replicas: tuple[int, ...] = (1,)
    heartbeat_s: float = 0.2
    """Longer than ``LiveConfig``'s defaults (0.1 / 0.5 / 0.25 s): on a loaded 2-core machine
    those evicted healthy replicas (their heartbeats starved). A SIGKILL is detected by the
    failed collective or the liveness EOF, not by the lease."""
    lease_s: float = 2.0
    stale_s: float = 1.0
    digest_every: int = 1
    warm_spares: int = 0
    """Pre-started spare processes (``launch --warm-spares``): one takes a killed replica's
    place instead of its torchrun's restart (docs/live-membership.md §6.3)."""
    step_sleep_s: float = 0.3
    """Stands in for a real step's compute: the demo model's step takes milliseconds, so
    without it the survivors would finish before the killed replica's torchrun has restarted
    it (process start and imports take seconds), and "full world again" would never be seen."""

    def __post_init__(self) -> None:
        if self.kill_point not in LIVE_KILL_POINTS:
            raise ValueError(
                f"kill_point={self.kill_point!r} is not a live kill point; use one of "
                f"{', '.join(LIVE_KILL_POINTS)}"
            )
        if self.kill_replicas and not 1 <= self.kill_step <= self.steps:
            raise ValueError(f"kill_step={self.kill_step} must be a step of 1..{self.steps}")
        bad = [r for r in self.kill_replicas if not 0 <= r < self.replicas]
        if bad or len(self.kill_replicas) >= self.replicas:
            raise ValueError(
                f"kill_replicas={self.kill_replicas}: name at most {self.replicas - 1} of the "
                f"replicas 0..{self.replicas - 1}"
            )

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(self.replicas) if r not in self.kill_replicas]

    def command(self) -> list[str]:
        timing = [f"--heartbeat-s={self.heartbeat_s}", f"--lease-s={self.lease_s}",
                  f"--stale-s={self.stale_s}"]  # fmt: skip
        return [
            sys.executable, "-m", "lm_resiliency.cli", "launch",
            "--replica-groups", str(self.replicas), "--nproc-per-group", "1",
            "--warm-spares", str(self.warm_spares), "--term-grace-s", "10",
            *[f"--coordinator-arg={t}" for t in timing],
            "--", "-m", "lm_resiliency.demo.live_kill", "--steps", str(self.steps),
            "--global-batch", str(self.global_batch), "--seed", str(self.seed), *timing,
            "--reform-timeout-s", "60", "--coordinator-timeout-s", "30",
            "--digest-every", str(self.digest_every), "--step-sleep-s", str(self.step_sleep_s),
        ]  # fmt: skip


@dataclass
class LiveJob:
    spec: LiveSpec
    run_dir: Path
    proc: subprocess.Popen[bytes]
    started: float
    """``time.time()`` at the launch."""
    healed: bool = False
    """Whether every killed replica committed the last step again (the heal admitted it)."""

    def stop(self) -> int:
        """SIGTERM the launcher if it still runs (it tears its tree down); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        path = self.run_dir / "launcher.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def start(spec: LiveSpec, run_dir: Path) -> LiveJob:
    env = dict(os.environ, LMR_LIVE_EVENTS=str(run_dir))
    env[KILL_REPLICAS_ENV] = ",".join(str(r) for r in spec.kill_replicas)
    if spec.kill_replicas:
        env[KILL_ENV] = f"{spec.kill_point}@{spec.kill_step}"
    else:
        env.pop(KILL_ENV, None)
    with (run_dir / "launcher.log").open("wb") as out:
        proc = subprocess.Popen(spec.command(), env=env, stdout=out, stderr=subprocess.STDOUT)
    return LiveJob(spec, run_dir, proc, time.time())


def follow(job: LiveJob, timeout_s: float, *, heal_wait_s: float = 0.0) -> str | None:
    """Wait for the run's end (see the module doc); ``None``, or what went wrong.

    ``heal_wait_s``: how long to wait, once the survivors finished, for a killed replica that
    registered as a joiner to be admitted and commit the last step too.
    """
    spec, run_dir = job.spec, job.run_dir
    deadline = time.monotonic() + timeout_s
    heal_deadline: float | None = None
    tails = {r: _Tail(run_dir / f"events-replica-{r}-rank-0.jsonl", spec.steps)
             for r in range(spec.replicas)}  # fmt: skip
    while True:
        for tail in tails.values():
            tail.read()
        done = all(tails[r].finished for r in spec.survivors)
        back = all(tails[r].joining for r in spec.kill_replicas)
        healed = all(tails[r].finished for r in spec.kill_replicas)
        if done and (healed or not spec.kill_replicas):
            job.healed = bool(spec.kill_replicas)
            break
        if done and back:
            heal_deadline = heal_deadline or time.monotonic() + heal_wait_s
            if time.monotonic() >= heal_deadline:
                break
        if job.proc.poll() is not None:
            if done:  # every group ended by itself: a joiner the end came before exits 0 too
                break
            return f"the launcher exited {job.proc.returncode} before the run finished"
        if time.monotonic() > deadline:
            return f"the run did not finish within {timeout_s:g} s"
        time.sleep(_POLL_S)
    rc = job.stop()  # 0 when it had finished, 128+15 when it was stopped with joiners waiting
    if rc not in (0, 128 + signal.SIGTERM):
        return f"the launcher exited {rc}"
    return None


class _Tail:
    """What :func:`follow` needs of one replica's event log, read as it grows.

    Only the lines appended since the last read are parsed: re-reading the whole log at every
    poll cost the training measurable CPU on a 2-core host (the logs grow by a few records per
    step).
    """

    def __init__(self, path: Path, last_step: int) -> None:
        self._path = path
        self._last_step = last_step
        self._offset = 0
        self.finished = False
        """It committed the run's last step."""
        self.joining = False
        """It registered as a joiner (a restarted replica)."""

    def read(self) -> None:
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in data[:end].splitlines():
            if line.endswith(b"}"):
                self._see(json.loads(line))

    def _see(self, record: dict[str, Any]) -> None:
        if record["event"] == "live.joining":
            self.joining = True
        elif record["event"] == "mtgs.commit" and record["step"] == self._last_step:
            self.finished = True

"""Run a script or module under the real torchrun elastic agent, bounded in time.

For tests and the demo: ``run_torchrun(["train.py", "--steps", "8"], nproc=4,
max_restarts=1, timeout_s=120)`` starts ``python -m torch.distributed.run`` with a
c10d rendezvous on loopback port 0 (the agent binds a free port itself, so no
other process can take it in between), waits, and returns a
:class:`CompletedRun` holding the agent's output and every worker's output per
attempt. Workers learn their attempt from ``TORCHELASTIC_RESTART_COUNT`` (set by
torchrun; see :func:`lm_resiliency.distributed.restart_count`).

:func:`start_torchrun` is the non-blocking form, for jobs that must run side by
side (one torchrun per simulated node, see :mod:`lm_resiliency.testing.netns`).

Per-attempt output comes from torchrun's own ``--log-dir``/``--redirects``/``--tee``:
the agent writes ``attempt_<n>/<local_rank>/{stdout,stderr}.log`` for every
worker group it starts, so the number of attempts is what torchrun did, not a
guess from log text. Linux only (the timeout kill walks ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lm_resiliency._proctree import descendants as _descendants
from lm_resiliency._proctree import signal_all as _signal_all

__all__ = [
    "CompletedRun",
    "TorchrunJob",
    "WorkerLog",
    "free_port",
    "kill_running_jobs",
    "run_torchrun",
    "start_torchrun",
]

_TERM_GRACE_S = 5.0
# Lines of C++ stack frames torch appends to errors; a summary leaves them out.
_FRAME_RE = re.compile(r"^\s*(frame #\d+:|Exception raised from |\[rank\d+\]:\s*frame #)")
# Strong references: a job whose caller's frame was unwound by a signal must still be found.
_LIVE: set[TorchrunJob] = set()


@dataclass(frozen=True)
class WorkerLog:
    """One worker's output in one attempt (torchrun restart) of the job."""

    attempt: int
    local_rank: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class CompletedRun:
    """Outcome of one torchrun invocation (one node's agent).

    ``returncode`` is the agent's exit status (0: the last worker group
    succeeded); ``stdout``/``stderr`` are the agent's streams, worker lines
    included with their ``[<role><local_rank>]:`` prefix, for every worker group
    it ran; ``attempts`` is the number of distinct ``TORCHELASTIC_RESTART_COUNT``
    values the agent used (1 + restarts after failures); ``workers`` holds each
    worker's own output per attempt; ``timed_out`` says the job was killed at
    its deadline. A restart caused by another node joining (a membership change)
    reuses the restart count, and torchrun then overwrites that attempt's worker
    logs; the agent's ``stdout`` keeps both groups' lines.
    """

    returncode: int
    stdout: str
    stderr: str
    attempts: int
    workers: tuple[WorkerLog, ...]
    timed_out: bool
    command: tuple[str, ...]

    def worker_stdout(self, attempt: int) -> list[str]:
        """The stdout of each worker of ``attempt``, in local-rank order."""
        return [w.stdout for w in self.workers if w.attempt == attempt]

    def brief(self, max_lines: int = 6) -> str:
        """A short failure summary for people: status, and the last lines of each stream.

        Keeps the last ``max_lines`` meaningful lines of the agent's stderr and of
        each worker's stderr in the last attempt, without torch's C++ stack frames;
        :meth:`describe` has everything.
        """
        last = max((w.attempt for w in self.workers), default=0)
        parts = [
            f"torchrun exit status {self.returncode}"
            + (" (killed at its deadline)" if self.timed_out else "")
            + f", {self.attempts} attempt(s)"
        ]
        streams = [("agent", self.stderr)] + [
            (f"attempt {w.attempt} local rank {w.local_rank}", w.stderr)
            for w in self.workers
            if w.attempt == last
        ]
        for name, text in streams:
            lines = [ln for ln in text.splitlines() if ln.strip() and not _FRAME_RE.match(ln)]
            if lines:
                parts.append(f"--- {name} (last {min(len(lines), max_lines)} lines)")
                parts += [ln[:300] for ln in lines[-max_lines:]]
        return "\n".join(parts)

    def describe(self) -> str:
        """A readable dump for assertion messages: command, status, every stream."""
        parts = [
            f"command: {' '.join(self.command)}",
            f"returncode={self.returncode} attempts={self.attempts} timed_out={self.timed_out}",
            f"--- agent stdout\n{self.stdout}",
            f"--- agent stderr\n{self.stderr}",
        ]
        for w in self.workers:
            parts.append(f"--- attempt {w.attempt} local rank {w.local_rank} stderr\n{w.stderr}")
        return "\n".join(parts)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the kernel picked it).

    Another process can take it before it is used. A single-node job does not
    need one (:func:`start_torchrun` lets the agent bind port 0); a multi-node
    rendezvous endpoint must be known to every agent up front.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TorchrunJob:
    """A running torchrun agent started by :func:`start_torchrun`."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        workdir: Path,
        command: Sequence[str],
        *,
        owns_workdir: bool,
    ) -> None:
        self._proc = proc
        self._workdir = workdir
        self._owns_workdir = owns_workdir
        self.command = tuple(command)
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        """Process id of the torchrun agent."""
        return self._proc.pid

    def poll(self) -> int | None:
        """The agent's exit status, or None while it runs."""
        return self._proc.poll()

    def stdout_so_far(self) -> str:
        """The agent's stdout written so far (worker lines included, prefixed)."""
        return _read(self._workdir / "agent.stdout")

    def wait(self, timeout_s: float) -> CompletedRun:
        """Wait up to ``timeout_s`` for the agent to exit, then collect its output.

        On timeout the agent and every process it started (workers run in their
        own sessions) get SIGTERM, then SIGKILL after a grace period; the result
        has ``timed_out=True``. Never raises for a failed or hung job: callers
        assert on the :class:`CompletedRun`. A temp directory the job created
        for its output is removed once the output is collected.
        """
        timed_out = False
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        _LIVE.discard(self)
        run = self._collect(timed_out)
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
        return run

    def kill(self) -> None:
        """Stop the agent and all its descendants (SIGTERM, grace, SIGKILL)."""
        tree = [self._proc.pid, *_descendants(self._proc.pid)]
        _signal_all(tree, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=_TERM_GRACE_S)
        _signal_all([*tree, *_descendants(self._proc.pid)], signal.SIGKILL)
        self._proc.wait()
        _LIVE.discard(self)

    def crash(self) -> None:
        """SIGKILL the agent and every worker at once, as a lost machine or an OOM kill of the
        whole job would (no grace, no handler runs)."""
        _signal_all([self._proc.pid, *_descendants(self._proc.pid)], signal.SIGKILL)
        self._proc.wait()
        _LIVE.discard(self)

    def _collect(self, timed_out: bool) -> CompletedRun:
        logs: list[WorkerLog] = []
        attempts = 0
        for attempt_dir in sorted(self._workdir.glob("logs/*/attempt_*")):
            attempt = int(attempt_dir.name.split("_", 1)[1])
            attempts = max(attempts, attempt + 1)
            for rank_dir in sorted(attempt_dir.iterdir(), key=lambda p: int(p.name)):
                logs.append(
                    WorkerLog(
                        attempt=attempt,
                        local_rank=int(rank_dir.name),
                        stdout=_read(rank_dir / "stdout.log"),
                        stderr=_read(rank_dir / "stderr.log"),
                    )
                )
        logs.sort(key=lambda w: (w.attempt, w.local_rank))
        returncode = self._proc.returncode
        return CompletedRun(
            returncode=returncode if returncode is not None else -1,
            stdout=_read(self._workdir / "agent.stdout"),
            stderr=_read(self._workdir / "agent.stderr"),
            attempts=attempts,
            workers=tuple(logs),
            timed_out=timed_out,
            command=self.command,
        )


def kill_running_jobs() -> int:
    """Stop every job this process started that is still running; returns how many.

    For a launcher interrupted by SIGTERM/SIGINT: the agents run in their own
    sessions, so a terminal's Ctrl-C does not reach them by itself.
    """
    jobs = [job for job in list(_LIVE) if job.poll() is None]
    for job in jobs:
        job.kill()
    return len(jobs)


def start_torchrun(
    entry: Sequence[str],
    nproc: int,
    *,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    rdzv_endpoint: str | None = None,
    nnodes: str = "1",
    local_addr: str | None = None,
    command_prefix: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
) -> TorchrunJob:
    """Start one torchrun agent with ``nproc`` workers running ``entry`` and return at once.

    ``entry`` is the script and its arguments (``["train.py", "--steps", "8"]``)
    or a module (``["-m", "pkg.train", "--steps", "8"]``). The rendezvous is c10d
    at ``rdzv_endpoint`` (default for one node: ``127.0.0.1:0``, the agent binds
    a free port itself; agents of a multi-node job must share one); ``nnodes`` is
    torchrun's ``--nnodes`` (``"2"`` or ``"1:2"``); ``local_addr`` is the address
    this node advertises (needed when the hostname does not resolve to a
    reachable address, e.g. in a network namespace). ``command_prefix`` is put
    before the Python command (``["ip", "netns", "exec", "ns"]``). Workers get
    ``OMP_NUM_THREADS=1`` and unbuffered output unless ``env`` says otherwise.
    Output goes to files under ``workdir`` (default: a temp directory, removed
    by :meth:`TorchrunJob.wait`), so several jobs can run at once without
    filling pipes.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} must be >= 0")
    if not entry:
        raise ValueError("entry is empty; pass a script path or ['-m', 'module']")
    owns = workdir is None
    work = Path(tempfile.mkdtemp(prefix="lmr-torchrun-") if workdir is None else workdir)
    work.mkdir(parents=True, exist_ok=True)
    # Port 0: the agent's TCPStore binds a free port itself; a port picked here and
    # handed over could be taken by another process first (a bind race).
    endpoint = rdzv_endpoint or ("127.0.0.1:0" if nnodes == "1" else f"127.0.0.1:{free_port()}")
    command = [
        *command_prefix,
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        # Failures are noticed within this interval (torch's default is 0.1 s in
        # recent versions but 5 s in older ones).
        "--monitor-interval=0.2",
        f"--log-dir={work / 'logs'}",
        "--redirects=3",
        "--tee=3",
        *([f"--local-addr={local_addr}"] if local_addr else []),
        *extra_args,
        *entry,
    ]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(work / "agent.stdout", "wb") as out, open(work / "agent.stderr", "wb") as err:
        proc = subprocess.Popen(
            command, stdout=out, stderr=err, env=child_env, start_new_session=True
        )
    return TorchrunJob(proc, work, command, owns_workdir=owns)


def run_torchrun(
    entry: Sequence[str],
    nproc: int,
    *,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    rdzv_port: int | None = None,
) -> CompletedRun:
    """Run ``entry`` under torchrun on loopback with ``nproc`` workers and wait for it.

    A single-node job with a c10d rendezvous on ``127.0.0.1:<rdzv_port>`` (port
    0 when None: the agent binds a free one) and ``--max-restarts=max_restarts``.
    The whole job is killed after ``timeout_s`` (result ``timed_out=True``). Returns the
    :class:`CompletedRun`; never raises for a failed job.
    """
    endpoint = f"127.0.0.1:{rdzv_port}" if rdzv_port is not None else None
    job = start_torchrun(entry, nproc, max_restarts=max_restarts, env=env, rdzv_endpoint=endpoint)
    return job.wait(timeout_s)


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""

"""``lm-resiliency launch``: one torchrun per replica group and a membership coordinator.

    lm-resiliency launch --replica-groups R --nproc-per-group N [--max-restarts K]
        [--coordinator HOST:PORT --run-id RUN] [--warm-spares S] [torchrun args] -- train.py ARGS
    lm-resiliency launch ... -- -m package.module ARGS

Each data-parallel replica group is the unit of failure (docs/live-membership.md §1): it runs
under its own ``torchrun --nnodes 1 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:0 --max-restarts K``, with its own rendezvous and agent store, so a lost worker
restarts only its own group. Without ``--coordinator`` the launcher first starts the membership
coordinator (``lm-resiliency coordinator``) as a child, waits until it is listening, and starts
it again with the next generation on the same port if it dies. With ``--coordinator HOST:PORT``
it uses one that is already running (the multi-node path) and starts none.

Every worker gets ``LMR_LIVE_COORDINATOR=host:port``, ``LMR_LIVE_RUN``, ``LMR_REPLICA_GROUP``
(0..R-1) and ``LMR_REPLICA_GROUPS`` (R) on top of torchrun's ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``, which count inside the group. A warm spare (``--warm-spares``, N=1 only) is one
more torchrun of one process with ``LMR_LIVE_SPARE=1`` and ``LMR_LIVE_SPARE_ID`` (the launcher's
label for it; the spare's id in the protocol comes from the coordinator) instead of a replica
id; it waits inside ``enable_resiliency`` to take over a lost replica (``live/spare.py``).

Like torchrun with several processes per node, the launcher sets ``OMP_NUM_THREADS=1`` for every
worker when the caller has not set it: its R·N workers (and spares) share one host, and torch's
default of one intra-op thread per core in each of them oversubscribes the cores (measured: the
demo's 4 replica groups on 2 cores stepped 5-15x slower). torchrun itself sets it only when its
own ``--nproc-per-node`` is above 1, which a group of one process is not.

The launcher is not an agent: it forwards SIGINT/SIGTERM to the torchruns, waits for them and
exits with the worst of their exit statuses (128+signal when it was stopped by a signal). At
exit nothing it started is left: it walks its whole process tree (it is the subreaper of its
descendants, so orphans are found too) and kills what is left after a grace period.

exit status: the worst torchrun exit status (0 when every group succeeded); 2 for a bad command
line or a coordinator that does not come up; 128+N when stopped by signal N.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from lm_resiliency import _proctree

__all__ = ["LaunchError", "LaunchPlan", "main", "register"]

PROG = "lm-resiliency launch"
_POLL_S = 0.1
_REAP_EVERY = 10
"""Orphans (zombies re-parented to the launcher) are reaped every this many polls."""
_OMP = "OMP_NUM_THREADS"
"""Set to 1 for every worker unless the caller set it (see the module doc)."""
# Options the launcher sets on every torchrun; a user's copy would break the per-group setup.
_OWNED = frozenset(
    {
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--max-restarts",
        "--standalone",
        "--master-addr",
        "--master-port",
        "--node-rank",
        "-m",
        "--module",
    }
)
_NO_REPLICA_DIMENSION = (
    "--replica-groups 1 has no replica dimension: live membership keeps the survivors of a lost "
    "replica group training, and with one group there are no survivors (a lost rank restarts the "
    "job and recovers from memory, as plain torchrun does). Use --replica-groups 2 or more, or "
    "run torchrun directly"
)


class LaunchError(Exception):
    """A launch that cannot go on; the message says what and how to fix it (exit status 2)."""


@dataclass(frozen=True)
class LaunchPlan:
    """A validated ``launch`` command line."""

    replica_groups: int
    nproc_per_group: int
    max_restarts: int
    warm_spares: int
    run_id: str
    coordinator: tuple[str, int] | None
    """An external coordinator's address, or None to start one."""
    coordinator_host: str
    coordinator_port: int
    coordinator_args: tuple[str, ...]
    coordinator_timeout_s: float
    term_grace_s: float
    torchrun_args: tuple[str, ...]
    entry: tuple[str, ...]

    def torchrun_command(self, name: str) -> list[str]:
        """The command of one group's (or spare's) torchrun."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={1 if name.startswith('spare') else self.nproc_per_group}",
            "--rdzv-backend=c10d",
            # Port 0: the agent binds a free port itself, so no other process can take it
            # between our choosing it and torchrun binding it.
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={self.run_id}-{name}",
            f"--max-restarts={self.max_restarts}",
            *self.torchrun_args,
            *self.entry,
        ]

    def coordinator_command(self, port: int, generation: int, ready_file: Path) -> list[str]:
        """The command of the coordinator child (interface 1 of docs/live-membership.md)."""
        return [
            sys.executable,
            "-m",
            "lm_resiliency.cli",
            "coordinator",
            "--host",
            self.coordinator_host,
            "--port",
            str(port),
            "--run-id",
            self.run_id,
            "--replica-groups",
            str(self.replica_groups),
            "--nproc-per-group",
            str(self.nproc_per_group),
            "--ready-file",
            str(ready_file),
            "--generation",
            str(generation),
            *self.coordinator_args,
        ]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica-groups",
        type=int,
        required=True,
        metavar="R",
        help="number of data-parallel replica groups (>= 2), one torchrun each",
    )
    parser.add_argument(
        "--nproc-per-group",
        type=int,
        required=True,
        metavar="N",
        help="workers per replica group (torchrun's --nproc-per-node)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="torchrun --max-restarts of each group (default: %(default)s)",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="use this running coordinator instead of starting one (multi-node); needs --run-id",
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help="live run id (default: a new one; must match --coordinator's)",
    )
    parser.add_argument(
        "--warm-spares",
        type=int,
        default=0,
        metavar="S",
        help="pre-started spare processes (N=1 only; default: 0)",
    )
    parser.add_argument(
        "--coordinator-host",
        default="127.0.0.1",
        help="address the started coordinator listens on (default: %(default)s)",
    )
    parser.add_argument(
        "--coordinator-port",
        type=int,
        default=0,
        help="its port (default: 0, a free one; kept across its restarts)",
    )
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the started coordinator, repeatable "
        "(e.g. --coordinator-arg=--lease-s=2)",
    )
    parser.add_argument(
        "--coordinator-timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the coordinator to listen (default: %(default)s)",
    )
    parser.add_argument(
        "--term-grace-s",
        type=float,
        default=15.0,
        help="after forwarding a signal, how long the torchruns get before "
        "everything left is killed (default: %(default)s)",
    )


def register(subparsers: Any) -> None:
    """Add the ``launch`` subcommand to the ``lm-resiliency`` parser (for ``--help``).

    ``lm-resiliency launch`` itself is parsed by :func:`main`, because the torchrun arguments
    and the training command after ``--`` are passed through untouched.
    """
    parser = subparsers.add_parser(
        "launch",
        help="run R replica groups under one torchrun each, with a membership coordinator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    return parser


def parse(argv: Sequence[str]) -> LaunchPlan:
    """Validate a ``launch`` command line; raises ``LaunchError`` naming the value and the fix."""
    argv = list(argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            _parser().parse_args(["--help"])
        raise LaunchError(
            "no training command: put it after '--', e.g. lm-resiliency launch --replica-groups "
            "2 --nproc-per-group 1 -- train.py --steps 10 (or -- -m package.module ARGS)"
        )
    cut = argv.index("--")
    ours, entry = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    try:
        args, torchrun_args = parser.parse_known_args(ours)
    except SystemExit as exc:  # argparse printed its message
        raise LaunchError("bad arguments (see above)") from exc
    if args.replica_groups < 1:
        raise LaunchError(f"--replica-groups {args.replica_groups} must be >= 2")
    if args.replica_groups == 1:
        raise LaunchError(_NO_REPLICA_DIMENSION)
    if args.nproc_per_group < 1:
        raise LaunchError(f"--nproc-per-group {args.nproc_per_group} must be >= 1")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.warm_spares < 0:
        raise LaunchError(f"--warm-spares {args.warm_spares} must be >= 0")
    if args.warm_spares and args.nproc_per_group != 1:
        raise LaunchError(
            f"--warm-spares {args.warm_spares} needs --nproc-per-group 1 (a spare cannot enter "
            f"another torchrun's rendezvous; got --nproc-per-group {args.nproc_per_group}); "
            "drop --warm-spares"
        )
    if args.coordinator_timeout_s <= 0 or args.term_grace_s < 0:
        raise LaunchError("--coordinator-timeout-s must be > 0 and --term-grace-s >= 0")
    if torchrun_args and not torchrun_args[0].startswith("-"):
        raise LaunchError(
            f"unexpected argument {torchrun_args[0]!r} before '--'; the training script and its "
            "arguments go after '--'"
        )
    for arg in torchrun_args:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in _OWNED:
            raise LaunchError(
                f"torchrun argument {arg!r} is set by the launcher for every replica group "
                "(each group is one node with its own c10d rendezvous); use --nproc-per-group, "
                "--max-restarts, or put -m MODULE after '--'"
            )
    if not entry or entry == ["-m"] or (entry[0] == "-m" and entry[1].startswith("-")):
        raise LaunchError(
            "no training command after '--': give a script (-- train.py ARGS) or a module "
            "(-- -m package.module ARGS)"
        )
    coordinator: tuple[str, int] | None = None
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"--coordinator {args.coordinator!r} is not HOST:PORT (e.g. 10.0.0.5:29600)"
            )
        if args.run_id is None:
            raise LaunchError(
                f"--coordinator {args.coordinator} needs --run-id: the run id the coordinator "
                "was started with (its keys live under lmr/live/<run>/)"
            )
        coordinator = (host, int(port))
    run_id = args.run_id or f"live-{uuid.uuid4().hex[:8]}"
    if "/" in run_id or not run_id.isprintable():
        raise LaunchError(f"--run-id {run_id!r} must be printable and contain no '/'")
    return LaunchPlan(
        replica_groups=args.replica_groups,
        nproc_per_group=args.nproc_per_group,
        max_restarts=args.max_restarts,
        warm_spares=args.warm_spares,
        run_id=run_id,
        coordinator=coordinator,
        coordinator_host=args.coordinator_host,
        coordinator_port=args.coordinator_port,
        coordinator_args=tuple(args.coordinator_arg),
        coordinator_timeout_s=args.coordinator_timeout_s,
        term_grace_s=args.term_grace_s,
        torchrun_args=tuple(torchrun_args),
        entry=tuple(entry),
    )


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _status(code: int) -> int:
    """A Popen return code as a shell exit status (a signal death as 128+N)."""
    return 128 - code if code < 0 else code


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    kept = [ln for ln in text.splitlines() if ln.strip()][-lines:]
    return "\n".join(kept) if kept else "(no output)"


def _child_setup() -> None:
    # The torchruns and the coordinator get SIGTERM if the launcher itself dies (even by
    # SIGKILL), so a lost launcher does not leave a job running.
    _proctree.die_with_parent(signal.SIGTERM)


class _Coordinator:
    """The coordinator child: started, waited for until it listens, restarted when it dies."""

    def __init__(self, plan: LaunchPlan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.generation = -1
        self.port = plan.coordinator_port
        self.host = plan.coordinator_host
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    def start(self, stopping: _Stop) -> None:
        if importlib.util.find_spec("lm_resiliency.cli.coordinator") is None:
            raise LaunchError(
                "this lm_resiliency has no coordinator subcommand (module "
                "lm_resiliency.cli.coordinator is missing), so the launcher cannot start one; "
                "start a coordinator yourself and pass --coordinator HOST:PORT --run-id RUN, or "
                "install a version that has 'lm-resiliency coordinator'"
            )
        self.generation += 1
        ready = self.workdir / f"coordinator-{self.generation}.ready"
        self._log = self.workdir / f"coordinator-{self.generation}.log"
        command = self.plan.coordinator_command(self.port, self.generation, ready)
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup,  # noqa: PLW1509 - no threads run in the launcher
            )
        deadline = time.monotonic() + self.plan.coordinator_timeout_s
        while not ready.exists():
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(
                    f"the coordinator ({' '.join(command[2:])}) exited with status "
                    f"{_status(code)} before it was listening; its last output:\n"
                    f"{_tail(self._log)}"
                )
            if stopping.signum is not None:
                raise LaunchError("stopped while the coordinator was starting")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the coordinator did not write its ready file {ready} within "
                    f"--coordinator-timeout-s {self.plan.coordinator_timeout_s}; its last "
                    f"output:\n{_tail(self._log)}"
                )
            time.sleep(_POLL_S)
        try:
            record = json.loads(ready.read_text())
            host, port, pid = str(record["host"]), int(record["port"]), int(record["pid"])
            int(record["live_port"]), int(record["generation"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LaunchError(
                f"the coordinator's ready file {ready} is not the JSON "
                '{"host", "port", "live_port", "pid", "generation"}: '
                f"{exc}: {ready.read_text(errors='replace')[:200]!r}"
            ) from None
        if pid != self.proc.pid:
            raise LaunchError(f"ready file {ready} names pid {pid}, not the coordinator's")
        self.host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        self.port = port  # a restart reuses it: the workers' env names it
        _say(
            f"coordinator listening at {self.host}:{self.port} (generation {self.generation}, "
            f"pid {pid}, log {self._log})"
        )

    def died(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Stop:
    """The first SIGINT/SIGTERM received; a second one kills without grace."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.again = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        else:
            self.again = True


def _reachable(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"no coordinator listening at --coordinator {host}:{port} ({exc}) within "
                    f"{timeout_s} s; start it first (lm-resiliency coordinator --port {port} "
                    "--run-id RUN ...) or check the address"
                ) from None
            time.sleep(0.2)


def _worker_env(
    plan: LaunchPlan, address: str, *, group: int | None, spare: int | None
) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LMR_REPLICA_GROUP", "LMR_LIVE_SPARE", "LMR_LIVE_SPARE_ID")
    }
    env.update(
        LMR_LIVE_COORDINATOR=address,
        LMR_LIVE_RUN=plan.run_id,
        LMR_REPLICA_GROUPS=str(plan.replica_groups),
    )
    if group is not None:
        env["LMR_REPLICA_GROUP"] = str(group)
    if spare is not None:
        env["LMR_LIVE_SPARE"] = "1"
        env["LMR_LIVE_SPARE_ID"] = str(spare)
    if _OMP not in env:
        env[_OMP] = "1"  # see the module doc: R * N workers share this host
    return env


class Launcher:
    """Runs one :class:`LaunchPlan` to the end (:meth:`run`); always leaves no process behind."""

    def __init__(self, plan: LaunchPlan, *, workdir: Path | None = None) -> None:
        self.plan = plan
        self._owns_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"lmr-launch-{plan.run_id}-"))
        self.groups: list[subprocess.Popen[bytes]] = []
        self.spares: list[subprocess.Popen[bytes]] = []
        self.coordinator: _Coordinator | None = None
        self.stop = _Stop()
        self._preexisting: set[int] = set()

    def run(self) -> int:
        # Processes this process already had (when the launcher runs inside a longer-lived
        # process, e.g. a test run's multiprocessing forkserver) are not the launcher's: its
        # teardown kills and reaps only what it started and what was orphaned to it.
        self._preexisting = set(_proctree.descendants(os.getpid()))
        subreaper = _proctree.set_child_subreaper()
        previous = {s: signal.signal(s, self.stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            self._teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if subreaper:
                _proctree.set_child_subreaper(False)
            if self._owns_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self) -> int:
        plan = self.plan
        if plan.coordinator is None:
            self.coordinator = _Coordinator(plan, self.workdir)
            self.coordinator.start(self.stop)
            address = f"{self.coordinator.host}:{self.coordinator.port}"
        else:
            host, port = plan.coordinator
            _reachable(host, port, plan.coordinator_timeout_s)
            address = f"{host}:{port}"
        if _OMP not in os.environ:
            _say(
                f"{_OMP}=1 for every worker ({plan.replica_groups} replica groups x "
                f"{plan.nproc_per_group} processes share this host; set {_OMP} to choose)"
            )
        for g in range(plan.replica_groups):
            self.groups.append(
                self._torchrun(f"g{g}", _worker_env(plan, address, group=g, spare=None))
            )
            _say(f"replica group {g}: torchrun pid {self.groups[-1].pid}")
        for s in range(plan.warm_spares):
            self.spares.append(
                self._torchrun(f"spare{s}", _worker_env(plan, address, group=None, spare=s))
            )
            _say(f"warm spare {s}: torchrun pid {self.spares[-1].pid}")
        failed_starts = 0
        polls = 0
        # Spares too: a spare that took a lost replica over trains it to the end, and one that
        # waits exits 0 when the coordinator publishes that the run finished.
        torchruns = [*self.groups, *self.spares]
        while self.stop.signum is None and any(p.poll() is None for p in torchruns):
            time.sleep(_POLL_S)
            polls += 1
            if polls % _REAP_EVERY == 0:  # a walk of /proc: ~3% of a core at every poll
                self._reap_orphans()
            code = None if self.coordinator is None else self.coordinator.died()
            if code is not None and self.coordinator is not None and failed_starts < 3:
                _say(
                    f"coordinator (generation {self.coordinator.generation}) exited with status "
                    f"{_status(code)}; starting generation {self.coordinator.generation + 1} on "
                    f"port {self.coordinator.port}"
                )
                try:
                    self.coordinator.start(self.stop)
                    failed_starts = 0
                except LaunchError as exc:
                    failed_starts += 1
                    _say(f"coordinator restart failed ({failed_starts}/3): {exc}")
                    if failed_starts == 3:
                        _say("not restarting the coordinator again; the workers fall back")
        if self.stop.signum is not None:
            _say(f"got signal {self.stop.signum}; stopping every replica group")
            return 128 + self.stop.signum
        codes = [_status(p.returncode) for p in self.groups]
        spares = [_status(p.returncode) for p in self.spares]
        also = f", warm spares with {spares}" if spares else ""
        _say(f"replica groups exited with {codes}{also}")
        return max(codes + spares)

    def _torchrun(self, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.plan.torchrun_command(name),
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup,  # noqa: PLW1509 - no threads run in the launcher
        )

    def _launched(self) -> list[int]:
        """This process's descendants minus those that predate the run (and their children)."""
        keep: set[int] = set()
        for pid in self._preexisting:
            if _proctree.alive(pid):
                keep.add(pid)
                keep.update(_proctree.descendants(pid))
        return [pid for pid in _proctree.descendants(os.getpid()) if pid not in keep]

    def _reap_orphans(self) -> None:
        # Orphaned descendants are re-parented to us (subreaper); reap those that exited.
        ours = {p.pid for p in [*self.groups, *self.spares]}
        if self.coordinator is not None and self.coordinator.proc is not None:
            ours.add(self.coordinator.proc.pid)
        for pid in self._launched():
            if pid not in ours:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)

    def _teardown(self) -> None:
        sig = signal.Signals(self.stop.signum or signal.SIGTERM)
        running = [p for p in [*self.groups, *self.spares] if p.poll() is None]
        for p in running:  # torchrun stops its own workers on SIGINT/SIGTERM
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
        deadline = time.monotonic() + self.plan.term_grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            if self.stop.again:
                break
            time.sleep(_POLL_S)
        if self.coordinator is not None:
            self.coordinator.stop(grace_s=0 if self.stop.again else 5.0)
        # Whatever is left (a torchrun past its grace, workers it did not stop, orphans).
        for _ in range(20):
            left = [pid for pid in self._launched() if _proctree.alive(pid)]
            if not left:
                break
            _proctree.signal_all(left, signal.SIGKILL)
            self._reap_orphans()
        for p in [*self.groups, *self.spares]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5.0)
        self._reap_orphans()


def main(argv: Sequence[str] | None = None, *, stderr: IO[str] | None = None) -> int:
    """Run ``lm-resiliency launch`` with ``argv`` (the arguments after ``launch``)."""
    out = stderr or sys.stderr
    try:
        plan = parse(sys.argv[2:] if argv is None else argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=out)
        return 2
    launcher = Launcher(plan)
    try:
        return launcher.run()
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=out)
        signum = launcher.stop.signum
        return 2 if signum is None else 128 + signum

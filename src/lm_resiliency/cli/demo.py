"""``lm-resiliency demo``: a torchrun training job loses a worker and recovers through GEMINI.

What it runs, on CPU with Gloo (about half a minute on 2 cores with the defaults):

1. torchrun's elastic launcher starts ``--world-size`` workers training a tiny
   GPT on synthetic text with DDP (``--framework fsdp2``: sharded with
   ``fully_shard``), through ``enable_resiliency``; GEMINI captures every ``--interval`` steps,
   replicates each capture to a peer rank and flushes to ``--disk-folder``
   every ``--flush-interval`` steps;
2. after ``--fault-step`` rank ``--fault-rank`` is SIGKILLed (first attempt only);
   the survivors' next collective fails and they exit on that error, as any
   training script does; torchrun restarts the worker group
   (``--max-restarts 1``). Every rank's memory slots are files on /dev/shm, so
   they outlive the processes;
3. the new workers re-attach to those slots, call ``find_latest()`` and
   ``load()`` (every rank restores from its own memory), restore model,
   optimizer, every RNG, the data position and DDP's bucket order (all through
   ``enable_resiliency``: the workers run the plain loop) and finish;
4. a second, fault-free torchrun job of the same seed, steps and world size
   runs, and the final parameters and optimizer state of both are compared
   with ``torch.equal``.

Files: everything goes to a temporary folder /tmp/lmr-demo-* (events, torchrun
logs and, without --disk-folder, GEMINI's node-local files); the demo says which
it removes at the end (all of it, unless it fails or --keep-files is given). A
demo stopped by SIGTERM or Ctrl-C stops its jobs and removes the folder too.

Exit status 0 only when the comparison passes; 1 otherwise; 2 for bad flags;
128 + the signal number when stopped by SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import importlib
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from lm_resiliency.demo.events import read_run_events
from lm_resiliency.demo.launch import DemoSpec, compare_final, start_job
from lm_resiliency.demo.timeline import summarize
from lm_resiliency.errors import ConfigError
from lm_resiliency.testing.torchrun import kill_running_jobs

_POLL_S = 0.2
_BAR = 24


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="kill a worker of a real torchrun training job and recover it through GEMINI",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=4, help="torchrun workers (default 4)")
    p.add_argument(
        "--live",
        action="store_true",
        help="live membership instead: 4 replica groups under lm-resiliency launch, replica "
        "--fault-rank SIGKILLed in step --fault-step (default 8 of 40), the survivors go on "
        "in the same processes",
    )
    p.add_argument(
        "--warm-spares",
        type=int,
        default=0,
        help="--live: pre-started spare processes; one takes the killed replica's place "
        "instead of its torchrun's restart (default 0)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default 40; --live: 40)"
    )
    p.add_argument("--interval", type=int, default=5, help="GEMINI capture every N steps (5)")
    p.add_argument(
        "--flush-interval",
        type=int,
        default=20,
        help="node-local flush every N steps (default 20; 0: only the SIGTERM flush)",
    )
    p.add_argument(
        "--fault-step",
        type=int,
        default=None,
        help="SIGKILL after this step (default: about 4/5 into the run, 33 of 40 steps)",
    )
    p.add_argument("--fault-rank", type=int, default=1, help="the rank to SIGKILL (default 1)")
    p.add_argument(
        "--disk-folder",
        type=Path,
        default=None,
        help="GEMINI node-local folder, never removed (default: inside the demo's temporary "
        "folder, removed afterwards unless --keep-files)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--framework",
        choices=("ddp", "fsdp2"),
        default="ddp",
        help="how the workers shard the model: DDP replicas (default) or FSDP2 (fully_shard)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="bound per torchrun job in seconds (300)"
    )
    p.add_argument(
        "--keep-files",
        action="store_true",
        help="keep the demo's temporary folder (events, torchrun logs, GEMINI files); it is "
        "always kept when the demo fails",
    )
    p.set_defaults(func=run)


def default_fault_step(steps: int, interval: int) -> int:
    """About 4/5 into the run (33 of 40), after the first capture, before the last step."""
    return max(interval, min(steps - 1, steps * 33 // 40))


def _check(args: argparse.Namespace) -> None:
    if args.steps is None:
        args.steps = 40
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise ConfigError(f"--timeout-s={args.timeout_s}: use a positive number of seconds")
    for name in ("steps", "interval"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}={getattr(args, name)}: use a positive number of steps")
    if args.fault_step is None:
        args.fault_step = default_fault_step(args.steps, args.interval)
    if args.world_size < 2:
        raise ConfigError(f"--world-size={args.world_size}: use at least 2 workers")
    if not 0 <= args.fault_rank < args.world_size:
        raise ConfigError(
            f"--fault-rank={args.fault_rank} is not a rank of --world-size={args.world_size}; "
            f"use 0..{args.world_size - 1}"
        )
    if not args.interval <= args.fault_step < args.steps:
        raise ConfigError(
            f"--fault-step={args.fault_step} must come after the first capture (--interval="
            f"{args.interval}) and before the last step (--steps={args.steps})"
        )


def run(args: argparse.Namespace) -> int:
    if args.live:
        live = importlib.import_module("lm_resiliency.cli.demo_live")  # torch only when used
        return int(live.run(args))
    try:
        _check(args)
        spec = DemoSpec(
            steps=args.steps,
            interval=args.interval,
            flush_interval=args.flush_interval,
            seed=args.seed,
            fault_step=args.fault_step,
            fault_rank=args.fault_rank,
            framework=args.framework,
        )
    except ConfigError as exc:
        print(f"lm-resiliency demo: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="lmr-demo-"))
    disk = args.disk_folder if args.disk_folder is not None else work / "gemini"
    what = "events, torchrun logs" + (", GEMINI's files" if args.disk_folder is None else "")
    fate = "kept (--keep-files)" if args.keep_files else "removed at the end unless the demo fails"
    print(f"files: {work} ({what}) is {fate}")
    if args.disk_folder is not None:
        print(f"files: GEMINI's node-local files go to {disk} (--disk-folder: never removed)")
    t0 = time.monotonic()
    passed = False
    stopped: str | None = None
    previous = _stop_on_sigterm()
    try:
        passed = _demo(args, spec, work, disk)
    except (_Stopped, KeyboardInterrupt) as exc:
        stopped = exc.name if isinstance(exc, _Stopped) else "SIGINT"
    finally:
        _cleanup(work, what, keep=args.keep_files or not (passed or stopped), previous=previous)
    if stopped is not None:
        print(f"STOPPED by {stopped} after {time.monotonic() - t0:.1f} s")
        return 128 + int(getattr(signal, stopped))
    print(f"{'PASS' if passed else 'FAIL'} in {time.monotonic() - t0:.1f} s")
    return 0 if passed else 1


class _Stopped(Exception):
    """SIGTERM arrived: unwind so the jobs are stopped and the temporary folder removed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _stop_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_stopped)


def _cleanup(work: Path, what: str, *, keep: bool, previous: Any) -> None:
    """Stop any job still running, then remove (or keep) the demo's temporary folder."""
    main = threading.current_thread() is threading.main_thread()
    if main:  # a second signal must not interrupt the cleanup half way
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        kill_running_jobs()
        if keep:
            print(f"kept {work} ({what})")
        else:
            for _ in range(3):  # a killed worker may still have been creating a file
                shutil.rmtree(work, ignore_errors=True)
                if not work.exists():
                    break
                time.sleep(0.2)
            print(f"removed {work} ({what}); --keep-files keeps it")
    finally:
        if main:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _demo(args: argparse.Namespace, spec: Any, work: Path, disk: Path) -> bool:
    n = args.world_size
    print(
        f"lm-resiliency demo: {n} workers under torchrun (Gloo, CPU), tiny GPT "
        f"({spec.framework.upper()}) on synthetic text, {spec.steps} steps, the plain loop with "
        "enable_resiliency\n"
        f"  GEMINI: capture every {spec.interval} steps into memory slots on /dev/shm (they "
        "outlive the worker), replicate to a peer rank, persist to "
        f"{disk} "
        + (f"every {spec.flush_interval} steps" if spec.flush_interval else "on SIGTERM only")
        + "\n"
        f"  fault: SIGKILL rank {spec.fault_rank} after step {spec.fault_step} "
        "(first attempt only); torchrun --max-restarts 1"
    )
    run_dir = work / "faulty"
    tag = uuid.uuid4().hex[:8]
    job = start_job(spec, run_dir, disk, nproc=n, run_id=f"demo-{tag}", max_restarts=1)
    progress = _Progress(spec.steps, n)
    done = _follow(job, run_dir, progress, args.timeout_s)
    summary = summarize(read_run_events(run_dir))
    if done.returncode != 0:
        print(f"the job failed; full logs in {run_dir}:\n{done.brief()}")
        return False
    _report(summary)

    print(f"reference: the same {spec.steps} steps without a fault ({n} workers)")
    ref_dir = work / "reference"
    t_ref = time.monotonic()
    ref_spec = DemoSpec(
        steps=spec.steps,
        interval=spec.interval,
        flush_interval=spec.flush_interval,
        seed=spec.seed,
        framework=spec.framework,
    )
    ref_job = start_job(ref_spec, ref_dir, disk, nproc=n, run_id=f"demo-ref-{tag}", max_restarts=0)
    ref = ref_job.wait(args.timeout_s)
    if ref.returncode != 0:
        print(f"the reference job failed; full logs in {ref_dir}:\n{ref.brief()}")
        return False
    print(f"  done in {time.monotonic() - t_ref:.1f} s")
    comparison = compare_final(run_dir, ref_dir)
    ref_digests = summarize(read_run_events(ref_dir)).finished
    same_digests = summary.finished == ref_digests and len(ref_digests) == n
    identical = comparison.identical and same_digests
    print(
        f"check: final parameters and optimizer state bit-identical to the fault-free run: "
        f"{identical} ({comparison.tensors} tensors of {n} ranks compared with torch.equal"
        + (f"; differing: {', '.join(comparison.mismatched[:5])}" if comparison.mismatched else "")
        + (f"; max abs diff {comparison.max_abs_diff:.3g}" if comparison.max_abs_diff else "")
        + f"; every rank's final-state digest equal to its reference's: {same_digests})"
    )
    return identical


class _Progress:
    """Live lines while the faulty job runs: a bar every tenth of the run, and the fault story."""

    def __init__(self, steps: int, world_size: int) -> None:
        self.steps = steps
        self.world_size = world_size
        self.every = max(1, steps // 10)
        self.last_bar = (-1, 0)  # (attempt, step) of the last bar printed
        self.seen: set[tuple[Any, ...]] = set()
        self.said: set[str] = set()

    def update(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            key = (r["pid"], r["event"], r["t"])
            if key in self.seen:
                continue
            self.seen.add(key)
            kind = r["event"]
            if kind == "step":
                self._bar(int(r["step"]), float(r["loss"]), int(r["attempt"] or 0))
            elif kind == "fault":
                self._say("fault", f"  ** rank {r['rank']} SIGKILLed after step {r['step']} **")
            elif kind == "sigterm":
                self._say(
                    "sigterm", "  torchrun noticed: SIGTERM to the survivors (GEMINI flushes)"
                )
            elif kind == "started" and "fault" in self.said:
                self._say("restart", "  torchrun restarted the worker group")
            elif kind == "recovered":
                self._say("recovered", f"  recovered step {r['step']} on every rank, training on")

    def _bar(self, step: int, loss: float, attempt: int) -> None:
        due = step % self.every == 0 or step == self.steps
        if not due or (attempt, step) <= self.last_bar:
            return
        self.last_bar = (attempt, step)
        filled = round(_BAR * step / self.steps)
        print(
            f"  [{'#' * filled}{'.' * (_BAR - filled)}] step {step:>4}/{self.steps}  "
            f"loss {loss:.3f}  attempt {attempt}",
            flush=True,
        )

    def _say(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(line, flush=True)


def _follow(job: Any, run_dir: Path, progress: _Progress, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while job.poll() is None and time.monotonic() < deadline:
        progress.update(read_run_events(run_dir))
        time.sleep(_POLL_S)
    done = job.wait(max(1.0, deadline - time.monotonic()))
    progress.update(read_run_events(run_dir))
    return done


def _report(summary: Any) -> None:
    rec = summary.recovery
    if rec is None:
        print("no recovery happened (did the fault fire?)")
        return
    print(f"failure: rank {rec.fault_rank} SIGKILLed after step {rec.fault_step}")
    exited = sorted(summary.peer_lost)
    if exited:
        print(f"  ranks {exited}: their next collective failed; they exited on the error")
    for rank in summary.sigterm_ranks:
        flushed = _flushed(rank, summary.flushed_on_sigterm.get(rank, {}))
        print(f"  rank {rank}: SIGTERM -> GEMINI's signal flush wrote {flushed}")
    print(f"recovery: all ranks agreed on step {rec.step} (the newest step every rank can load)")
    for rank, source in sorted(rec.sources.items()):
        print(f"  rank {rank}: {source}{_how(rank, source, rec.step, summary)}")
    if rec.walked_back_from:
        print(f"  walked back past unusable steps {rec.walked_back_from}")
    print(
        f"lost steps: {rec.lost_steps} (fault after step {rec.fault_step}, resumed from {rec.step})"
    )
    total = f"{rec.total_s:.2f} s" if rec.total_s is not None else "n/a"
    print(f"recovery time: {total} from the kill to the first step after recovery")
    for name, what in _PHASES.items():
        if name in rec.phases_s:
            print(f"  {name:<10} {rec.phases_s[name]:7.3f} s  {what}")


def _how(rank: int, source: str, step: int, summary: Any) -> str:
    if source == "own memory":
        return " (its memory slot, re-attached by the restarted worker)"
    if source == "peer memory":
        return " (the replica its peer holds in memory, sent over the network)"
    if "disk" in source:
        return _written_by(rank, step, summary.flushed_on_sigterm)
    return ""


_PHASES = {
    "detection": "kill -> a survivor noticed (its collective failed, or SIGTERM)",
    "restart": "-> new workers spawned (survivors exit, re-rendezvous)",
    "startup": "new workers: interpreter, imports, process group, GEMINI manager",
    "agreement": "find_latest(): every rank's sources gathered, newest common step",
    "load": "load() + restoring model, optimizer, RNGs, data position, DDP bucket order",
}


def _written_by(rank: int, step: int, flushed: dict[int, dict[str, Any]]) -> str:
    """Which survivor's signal flush wrote ``rank``'s file of ``step`` from its replica.

    Only said when ``rank`` did not write that file itself (a dead rank cannot).
    """
    own = flushed.get(rank, {}).get("own_current")
    if own is not None and own["step"] == step:
        return ""
    for holder, slots in sorted(flushed.items()):
        slot = slots.get("peer_current")
        if slot and (slot["owner"], slot["step"]) == (rank, step) and holder != rank:
            return f" (the file rank {holder} wrote from its replica on SIGTERM)"
    return ""


def _flushed(rank: int, slots: dict[str, Any]) -> str:
    """What a rank's signal flush persisted: its newest own state and the replica it holds."""
    parts = []
    for role in ("own_current", "peer_current"):
        slot = slots.get(role)
        if slot is None:
            continue
        owner = "its own state" if slot["owner"] == rank else f"its replica of rank {slot['owner']}"
        parts.append(f"{owner} at step {slot['step']}")
    return ", ".join(parts) or "nothing new (already on disk)"

"""``lm-resiliency demo --live``: 4 replica groups, one SIGKILLed, the survivors never restart.

What it runs, on CPU with Gloo (about a minute on 2 cores):

1. ``lm-resiliency launch --replica-groups 4 --nproc-per-group 1`` starts the membership
   coordinator and 4 torchruns of one process each; each trains the demo's tiny GPT in the
   plain MTGS loop (``lm_resiliency.demo.live_worker``: ``enable_resiliency(..., mtgs=,
   live=)``, a ``DataLoader`` with ``batch_sampler=handle.sampler(...)``), gradients averaged
   across the replica groups;
2. replica ``--fault-rank`` (1) is SIGKILLed inside the forward of step ``--fault-step`` (8 of 12);
   the survivors leave the failed all-reduce, agree on a new membership epoch, rebuild their
   cross-replica group and redo the step over the same global batch, in the same processes;
   the killed replica's torchrun restarts it and it registers as a joiner;
3. ``check_run`` checks the event logs (docs/live-membership.md §9): no survivor restarted, no
   step skipped or repeated, every sample of every committed step consumed exactly once, every
   replica's state digest equal after every commit; the summary prints the timings.

Exit status 0 only when every check passes; 1 otherwise; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lm_resiliency.demo.live_launch import LiveSpec, follow, start
from lm_resiliency.demo.live_timeline import kill_timeline
from lm_resiliency.demo.live_worker import SAMPLES
from lm_resiliency.live.runcheck import check_run, read_events

__all__ = ["run"]

STEPS = 40
FAULT_STEP = 8
_HEAL_WAIT_S = 30.0


def heal_available() -> bool:
    """Whether this install admits a restarted replica (the heal of docs/live-membership.md §6)."""
    return importlib.util.find_spec("lm_resiliency.live.heal") is not None


def run(args: argparse.Namespace) -> int:
    steps = STEPS if args.steps is None else args.steps
    fault_step = FAULT_STEP if args.fault_step is None else args.fault_step
    try:
        spec = LiveSpec(
            steps=steps,
            kill_step=fault_step,
            kill_replicas=(args.fault_rank,),
            seed=args.seed,
            warm_spares=args.warm_spares,
        )
    except ValueError as exc:
        print(f"lm-resiliency demo --live: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="lmr-live-demo-"))
    spares = (
        f"  warm spares: {spec.warm_spares} (one takes the killed replica's place)\n"
        if spec.warm_spares
        else ""
    )
    print(
        f"lm-resiliency demo --live: {spec.replicas} replica groups of 1 process under "
        f"lm-resiliency launch (Gloo, CPU), tiny GPT, {spec.steps} steps, global batch "
        f"{spec.global_batch}, the plain MTGS loop with live membership\n"
        f"  fault: SIGKILL replica {args.fault_rank} in the forward of step {fault_step}\n"
        f"{spares}"
        f"files: {work} (event logs, launcher log) is removed at the end unless the demo fails"
        + (" (--keep-files keeps it)" if not args.keep_files else "")
    )
    t0 = time.monotonic()
    passed = False
    try:
        passed = _demo(spec, work, args.timeout_s)
    finally:
        keep = args.keep_files or not passed
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            print(f"removed {work}")
    print(f"{'PASS' if passed else 'FAIL'} in {time.monotonic() - t0:.1f} s")
    return 0 if passed else 1


def _demo(spec: LiveSpec, work: Path, timeout_s: float) -> bool:
    healing = heal_available()
    job = start(spec, work)
    try:
        problem = follow(job, timeout_s, heal_wait_s=_HEAL_WAIT_S if healing else 0.0)
    finally:
        job.stop()
    if problem is not None:
        print(f"the run failed: {problem}; launcher log:\n{job.log_tail()}")
        return False
    (killed,) = spec.kill_replicas
    try:
        run = check_run(work, stream=(spec.seed, SAMPLES, spec.global_batch))
        timeline = kill_timeline(work, run, killed, spec.kill_step)
    except AssertionError as exc:
        print(f"check failed: {exc}")
        return False
    survivors = list(spec.survivors)
    same_pids = all(len(run.pids[r]) == 1 for r in survivors)
    print(
        f"failure: replica {killed} SIGKILLed in step {spec.kill_step}; survivors {survivors} "
        f"kept their processes: {'yes' if same_pids else 'no'}"
    )
    print(
        f"first committed step of the survivors {timeline.first_commit_s:.2f} s after the kill "
        f"(step {spec.kill_step}, redone by {len(survivors)} replicas over the same global batch)"
    )
    for name, value in timeline.phases().items():
        if value is not None:
            print(f"  {name:<14} {value:7.3f} s")
    if spec.step_sleep_s:
        print(
            f"  (each forward sleeps {spec.step_sleep_s:g} s, a stand-in for real compute: the "
            "survivors ack at their next collective, after it, and the redo runs it again; "
            "benchmarks/live.py measures the bare step)"
        )
    if timeline.full_world_s is not None:
        took = any(r["event"] == "live.takeover" for r in read_events(work))
        how = "a warm spare took its place" if took else "its torchrun restarted it"
        print(f"full world again {timeline.full_world_s:.2f} s after the kill ({how})")
    elif healing:
        print(f"full world again: not reached (replica {killed} was not admitted)")
    else:
        print(
            f"full world again: not in this build (the heal is not merged); replica {killed}, "
            "restarted by its torchrun, is waiting as a joiner"
        )
    # check_run passed: every committed step consumed its global batch exactly once, so the
    # samples lost are those of steps never committed
    lost = (spec.steps - run.last_step) * spec.global_batch
    print(f"samples lost: {lost} (every sample of the {run.last_step} committed steps consumed "
          "exactly once)")  # fmt: skip
    digested = all(c.get("digest") for commits in run.commits.values() for c in commits)
    print(f"replica digests identical after every commit: {'yes' if digested else 'no'}")
    print(f"final digest {run.final_digest} (step {run.last_step})")
    healed = timeline.full_world_s is not None or not healing
    return same_pids and lost == 0 and digested and healed

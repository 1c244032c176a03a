"""The demo's training script, run by torchrun on every rank.

``python -m lm_resiliency.demo.worker --run-dir ... --steps ...``

Per worker process:

1. forms the Gloo group with :func:`lm_resiliency.distributed.init_process_group`
   (works in every generation torchrun starts) and builds the model
   (``--framework ddp`` or ``fsdp2``), the optimizer and the data stream;
2. calls ``enable_resiliency(model, optimizer, interval=..., state={"data": ...})``
   (run id from ``LM_RESILIENCY_RUN_ID``, stable across restarts): it recovers
   the newest step every rank can load and restores model, optimizer, every
   RNG, the data position and DDP's gradient bucket order; a first generation
   finds nothing and starts at step 1. The memory slots of the previous
   generation's processes are files on ``/dev/shm`` (the manager's
   ``memory_folder``), so a restarted worker recovers from memory;
3. trains with the plain loop (forward/backward, ``optimizer.step()``,
   ``zero_grad()``): the captures hang off the optimizer's step hooks, the
   node-local flush runs every ``--flush-interval`` steps; nothing catches errors;
4. writes each rank's final parameters and optimizer state (its shards under
   FSDP2) to ``<run-dir>/final-state-rank-<R>.safetensors`` and a digest.

Faults, first generation only (a marker file in the run folder records that a
fault already happened, so a restarted or replacement worker never repeats it):

* ``--fault-step S --fault-rank R``: after step S, once the last capture is
  replicated on every rank, rank R SIGKILLs itself;
* ``--hold-step S``: after step S every rank idles in a heartbeat loop until a
  peer is lost (the node-loss test kills a node from outside), or until
  ``<run-dir>/hold-released`` exists.

A rank whose collective fails because a peer died exits on that error, like
any real training script: its committed memory slots stay on the node for the
next generation. (If torchrun's SIGTERM arrives first, GEMINI's signal flush
also persists a consistent set of slots to disk.)

Everything the parent learns comes from JSON-lines records
(:mod:`lm_resiliency.demo.events`) and the safetensors file; nothing is pickled.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.demo.events import process_start_time, run_event_log
from lm_resiliency.demo.training import FRAMEWORKS, Trainer, digest
from lm_resiliency.distributed import init_process_group, restart_count
from lm_resiliency.frontdoor import enable_resiliency
from lm_resiliency.telemetry import EventLog

FAULT_MARKER = "fault-injected"
HOLD_MARKER = "hold-released"
FINAL_STATE_PREFIX = "final-state-rank-"
_HEARTBEAT_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lm_resiliency.demo.worker", description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True, help="records and final state go here")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, required=True, help="GEMINI capture every N steps")
    p.add_argument("--flush-interval", type=int, required=True, help="node-local flush cadence")
    p.add_argument("--disk-folder", type=Path, required=True, help="this node's GEMINI folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-step", type=int, default=0, help="0: no fault")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--hold-step", type=int, default=0, help="0: never hold")
    p.add_argument("--pg-timeout-s", type=float, default=30.0)
    p.add_argument("--framework", choices=FRAMEWORKS, default="ddp", help="ddp or fsdp2")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    events = run_event_log(args.run_dir, rank=rank, attempt=restart_count())
    events.emit("started", t=process_start_time())
    _record_exit_errors(events)
    init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    events.emit("group_formed", world_size=dist.get_world_size())
    trainer = Trainer(
        args.seed, rank=rank, world_size=dist.get_world_size(), framework=args.framework
    )
    holder: list[Any] = []
    # Installed before the manager's own handler, so it runs after GEMINI's flush.
    _on_sigterm(lambda: events.emit("sigterm_flushed", slots=_slot_states(holder)))
    config = InMemoryCkptConfig(
        disk_flush_interval=args.flush_interval,
        disk_folder=args.disk_folder,
        replication_jump=-1,  # ranks per node: the replica lives on another node
    )
    t0 = time.time()
    # The front door: recovers the newest common step (or none) and from now on
    # captures every --interval optimizer steps through the optimizer's hooks.
    resiliency = enable_resiliency(
        trainer.model,
        trainer.optimizer,
        interval=args.interval,
        config=config,
        state={"data": trainer.data},
    )
    holder.append(resiliency.manager)
    # Installed after it, so it runs first: the agent's SIGTERM, before the flush.
    _on_sigterm(lambda: events.emit("sigterm", slots=_slot_states(holder)))
    _report_recovery(resiliency, events, rank, t0)
    _train(args, resiliency, trainer, events, rank)
    resiliency.manager.wait_persisted()
    dist.barrier()
    final = trainer.final_tensors()
    save_file(final, str(args.run_dir / final_state(rank)))
    events.emit("finished", digest=digest(final), step=args.steps, stats=_stats(resiliency))
    resiliency.close()
    dist.destroy_process_group()
    return 0


def final_state(rank: int) -> str:
    """The file holding ``rank``'s final parameters and optimizer state."""
    return f"{FINAL_STATE_PREFIX}{rank}.safetensors"


def _report_recovery(resiliency: Any, events: EventLog, rank: int, t0: float) -> None:
    """The events the summary reads: manager ready, then a fresh start or the recovery."""
    info = resiliency.last_recovery
    manager = resiliency.manager
    plan = manager.plan
    # enable_resiliency builds the manager, then recovers: the recovery's own time
    # is known, so "ready" is the moment it began.
    events.emit(
        "manager_ready",
        t=time.time() - info.seconds,
        run_id=manager.run_id,
        sends_to=plan.send_to(rank) if plan is not None and plan.has_peer else None,
    )
    report = info.report
    if info.source != "gemini" or report is None:
        events.emit("fresh_start", find_latest_s=info.seconds)
        return
    agree = report.phases_s.get("agree", 0.0)
    events.emit(
        "recovered",
        step=resiliency.start_step,
        agreed=report.step,
        sources=list(info.sources),
        bytes_moved=report.bytes_moved,
        walked_back_from=report.walked_back_from,
        phases_s=report.phases_s,
        find_latest_s=agree,
        load_s=info.seconds - agree,
        apply_s=0.0,
        enable_s=time.time() - t0,
    )


def _train(
    args: argparse.Namespace,
    resiliency: Any,
    trainer: Trainer,
    events: EventLog,
    rank: int,
) -> None:
    start = resiliency.start_step + 1
    for step in range(start, args.steps + 1):  # the plain loop: nothing else in it
        loss = trainer.forward_backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            events.emit("step", step=step, loss=loss)
        if step == start and start > 1:
            events.emit("resumed", step=step)
        if step == args.fault_step and not (args.run_dir / FAULT_MARKER).exists():
            _inject_fault(args, resiliency.manager, events, rank, step)
        if step == args.hold_step and not (args.run_dir / HOLD_MARKER).exists():
            _hold(args, resiliency.manager, events, step)


def _inject_fault(
    args: argparse.Namespace,
    manager: Any,
    events: EventLog,
    rank: int,
    step: int,
) -> None:
    # Between captures, after the last one is replicated everywhere: the fault
    # this demo shows is a crash, not a torn replication (tests cover that).
    manager.wait_persisted()
    dist.barrier()
    if rank != args.fault_rank:
        return
    (args.run_dir / FAULT_MARKER).touch()
    events.emit("fault", step=step, signal="SIGKILL")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _hold(args: argparse.Namespace, manager: Any, events: EventLog, step: int) -> None:
    manager.wait_persisted()
    dist.barrier()
    events.emit("holding", step=step)
    while not (args.run_dir / HOLD_MARKER).exists():
        dist.all_reduce(torch.ones(1))  # raises once a peer is gone
        time.sleep(_HEARTBEAT_S)


def _record_exit_errors(events: EventLog) -> None:
    """Record the error a survivor exits on (observability only: nothing is caught)."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        events.emit("peer_lost", error=f"{exc_type.__name__}: {str(exc)[:400]}")
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _on_sigterm(action: Any) -> None:
    """Run ``action()`` on SIGTERM, then whatever handled SIGTERM before (or die by it)."""
    previous = signal.getsignal(signal.SIGTERM)

    def handle(signum: int, frame: FrameType | None) -> None:
        action()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, handle)


def _slot_states(holder: list[Any]) -> dict[str, Any]:
    """Each slot's step, state and owner (what a signal flush changes)."""
    if not holder:
        return {}
    return {
        role: {"step": slot.step, "state": slot.state.name, "owner": slot.owner_rank}
        for role, slot in holder[0].slots().items()
    }


def _stats(resiliency: Any) -> dict[str, Any]:
    manager = resiliency.manager
    capture = manager.stats
    repl = manager.replication_stats
    blocking = resiliency.stats.per_capture_s()
    return {
        "captures": capture.captures,
        "save_ms_mean": 1e3 * sum(capture.save_s) / max(1, len(capture.save_s)),
        "blocking_ms_mean": 1e3 * sum(blocking) / max(1, len(blocking)),
        "replicated": repl.replicated if repl is not None else 0,
        "replication_failures": repl.failures if repl is not None else 0,
        "flushed": manager.flush_stats.written,
    }


if __name__ == "__main__":
    sys.exit(main())

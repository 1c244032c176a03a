"""The demo's training script, run by torchrun on every rank.

``python -m lm_resiliency.demo.worker --run-dir ... --steps ...``

Per worker process:

1. forms the Gloo group with :func:`lm_resiliency.distributed.init_process_group`
   (works in every generation torchrun starts), builds the model and the
   GEMINI manager (run id from ``LM_RESILIENCY_RUN_ID``, stable across restarts);
2. recovers: ``find_latest()`` then ``load()`` on every rank; restores model,
   optimizer, RNG and data position and primes DDP's buckets; a first
   generation finds nothing and starts at step 1. The memory slots of the
   previous generation's processes are files on ``/dev/shm`` (the manager's
   ``memory_folder``), so a restarted worker recovers from memory;
3. trains with the contract's loop, verbatim (``maybe_wait`` before
   ``optimizer.step``, ``save`` every ``--interval`` steps, node-local flush
   every ``--flush-interval`` steps); nothing catches errors;
4. writes the final parameters and optimizer state to
   ``<run-dir>/final-state.safetensors`` (rank 0) and a digest per rank.

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
from lm_resiliency.demo.events import EventLog, process_start_time
from lm_resiliency.demo.training import Trainer, digest
from lm_resiliency.distributed import init_process_group, restart_count
from lm_resiliency.experimental import InMemoryCheckpointManager

FAULT_MARKER = "fault-injected"
HOLD_MARKER = "hold-released"
FINAL_STATE = "final-state.safetensors"
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    events = EventLog(args.run_dir, rank=rank, attempt=restart_count())
    events.emit("started", t=process_start_time())
    _record_exit_errors(events)
    init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    events.emit("group_formed", world_size=dist.get_world_size())
    trainer = Trainer(args.seed, rank=rank, world_size=dist.get_world_size())
    holder: list[InMemoryCheckpointManager] = []
    # Installed before the manager's own handler, so it runs after GEMINI's flush.
    _on_sigterm(lambda: events.emit("sigterm_flushed", slots=_slot_states(holder)))
    config = InMemoryCkptConfig(
        interval=args.interval,
        disk_flush_interval=args.flush_interval,
        disk_folder=args.disk_folder,
        replication_jump=-1,  # ranks per node: the replica lives on another node
    )
    manager = InMemoryCheckpointManager(config)
    holder.append(manager)
    # Installed after it, so it runs first: the agent's SIGTERM, before the flush.
    _on_sigterm(lambda: events.emit("sigterm", slots=_slot_states(holder)))
    plan = manager.plan
    events.emit(
        "manager_ready",
        run_id=manager.run_id,
        sends_to=plan.send_to(rank) if plan is not None and plan.has_peer else None,
    )
    start = _recover(manager, trainer, events) + 1
    _train(args, manager, trainer, events, rank, start)
    manager.wait_persisted()
    dist.barrier()
    final = trainer.final_tensors()
    if rank == 0:
        save_file(final, str(args.run_dir / FINAL_STATE))
    events.emit("finished", digest=digest(final), step=args.steps, stats=_stats(manager))
    manager.close()
    dist.destroy_process_group()
    return 0


def _recover(manager: InMemoryCheckpointManager, trainer: Trainer, events: EventLog) -> int:
    """Collective: restore the newest common step, or 0 when there is none."""
    t0 = time.time()
    step = manager.find_latest()
    t1 = time.time()
    if step is None:
        events.emit("fresh_start", find_latest_s=t1 - t0)
        return 0
    state = manager.load(step)
    t2 = time.time()
    resumed = trainer.restore(state)
    t3 = time.time()
    report = manager.last_recovery
    assert report is not None
    events.emit(
        "recovered",
        step=resumed,
        agreed=step,
        sources=report.sources,
        bytes_moved=report.bytes_moved,
        walked_back_from=report.walked_back_from,
        phases_s=report.phases_s,
        find_latest_s=t1 - t0,
        load_s=t2 - t1,
        apply_s=t3 - t2,
    )
    return resumed


def _train(
    args: argparse.Namespace,
    manager: InMemoryCheckpointManager,
    trainer: Trainer,
    events: EventLog,
    rank: int,
    start: int,
) -> None:
    for step in range(start, args.steps + 1):
        loss = trainer.forward_backward()
        manager.maybe_wait()  # the previous capture is complete before parameters change
        trainer.optimizer_step()
        if step % args.interval == 0:
            manager.save(trainer.state(step), step)
        if rank == 0:
            events.emit("step", step=step, loss=loss)
        if step == start and start > 1:
            events.emit("resumed", step=step)
        if step == args.fault_step and not (args.run_dir / FAULT_MARKER).exists():
            _inject_fault(args, manager, events, rank, step)
        if step == args.hold_step and not (args.run_dir / HOLD_MARKER).exists():
            _hold(args, manager, events, step)


def _inject_fault(
    args: argparse.Namespace,
    manager: InMemoryCheckpointManager,
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


def _hold(
    args: argparse.Namespace, manager: InMemoryCheckpointManager, events: EventLog, step: int
) -> None:
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


def _slot_states(holder: list[InMemoryCheckpointManager]) -> dict[str, Any]:
    """Each slot's step, state and owner (what a signal flush changes)."""
    if not holder:
        return {}
    return {
        role: {"step": slot.step, "state": slot.state.name, "owner": slot.owner_rank}
        for role, slot in holder[0].slots().items()
    }


def _stats(manager: InMemoryCheckpointManager) -> dict[str, Any]:
    capture = manager.stats
    repl = manager.replication_stats
    return {
        "captures": capture.captures,
        "save_ms_mean": 1e3 * sum(capture.save_s) / max(1, len(capture.save_s)),
        "replicated": repl.replicated if repl is not None else 0,
        "replication_failures": repl.failures if repl is not None else 0,
        "flushed": manager.flush_stats.written,
    }


if __name__ == "__main__":
    sys.exit(main())

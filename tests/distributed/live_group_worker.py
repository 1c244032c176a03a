"""One bare replica process looping on all-reduce through ``CrossReplicaGroup`` (a script).

Run by ``test_live_group.py`` as a plain ``python`` process, so that its exit goes through
the interpreter's real teardown (the point of the clean-exit check). The victim launches
its all-reduce of iteration ``--kill-iter`` and SIGKILLs itself while its peers are inside
it. Each iteration ends with a one-element all-reduce, its commit point (``_confirm``).
Survivors leave through ``EpochFailed``, acknowledge, rebuild under the next epoch, redo
the iteration and go on; at the end each prints one JSON line and exits normally.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from live_fixtures import StoreView

from lm_resiliency.live.group import CrossReplicaGroup, graveyard_size
from lm_resiliency.live.keys import Ack
from lm_resiliency.live.view import EpochFailed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--victim", type=int, required=True)
    ap.add_argument("--kill-iter", type=int, required=True)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--slow-teardown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    view = StoreView(args.port, args.run, args.replica, args.replicas)
    group = CrossReplicaGroup.build(view, epoch=view.epoch, members=view.members)
    changes = []
    sums = []
    it = 0
    while it < args.iters:
        x = torch.full((args.numel,), float(args.replica + 1))
        fut = group.allreduce(x)
        if args.replica == args.victim and it == args.kill_iter:
            view.store().set("test/kill_t", repr(time.time()))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            group.wait(fut)
            _confirm(group)
        except EpochFailed as exc:
            t_out = time.time()
            group.abandon(exc.cause)
            record = view.reform(Ack(inc=view.incarnation, committed=it, pid=os.getpid()))
            t_record = time.time()
            group = CrossReplicaGroup.build(view, epoch=record.epoch, members=record.members)
            t_built = time.time()
            x = torch.full((args.numel,), float(args.replica + 1))
            group.wait(group.allreduce(x))  # redo the iteration under the new epoch
            _confirm(group)
            changes.append(
                {
                    "iter": it,
                    "epoch": record.epoch,
                    "members": list(record.members),
                    "cause": exc.cause,
                    "t_out": t_out,
                    "t_record": t_record,
                    "t_built": t_built,
                    "t_first_allreduce": time.time(),
                    "build_s": group.build_s,
                }
            )
        expected = float(sum(m + 1 for m in group.members))
        sums.append({"iter": it, "epoch": group.epoch, "ok": bool((x == expected).all())})
        it += 1
    kill_t = view.store().get("test/kill_t").decode() if changes else "nan"
    print(
        json.dumps(
            {
                "replica": args.replica,
                "pid": os.getpid(),
                "changes": changes,
                "sums": sums,
                "kill_t": float(kill_t),
                "graveyard": graveyard_size(),
            }
        ),
        flush=True,
    )


def _confirm(group: CrossReplicaGroup) -> None:
    """The iteration's commit point, as MTGS's commit confirmation is a step's.

    A peer's share of a small all-reduce can reach some members before it dies, so the
    all-reduce itself may complete on some survivors and fail on others: the group cannot
    make them agree on it. A second all-reduce, which the dead peer never launched, fails on
    every survivor, so they all redo the same iteration.
    """
    group.wait(group.allreduce(torch.ones(1)))


class _SlowTeardown:
    """Keeps the interpreter's teardown busy while the peers exit (their sockets close)."""

    def __del__(self) -> None:
        time.sleep(2.0)


if __name__ == "__main__":
    main()
    if "--slow-teardown" in sys.argv:
        # A module global: destroyed during finalization, after atexit. An abandoned
        # all-reduce that failed only now would call back into a dying interpreter.
        _teardown = _SlowTeardown()
    else:
        time.sleep(1.0)  # exit after the slow one entered its teardown

"""Live membership on NCCL: a replica SIGKILLed inside a bucket all-reduce, the survivors go on.

Run on a CUDA host: ``PYTHONPATH=src python3 scripts/gpu_live_check.py``. ``--dry-run`` runs
the same flow on Gloo with CPU tensors (no GPU needed; how CI-less machines exercise the
script's logic).

R bare replica processes (N = 1 each; R = ``--replicas``, default min(4, GPUs), at least 2)
all-reduce a bucket through ``CrossReplicaGroup`` over a coordinator store. The coordinator
is the test driver ``tests/distributed/live_fixtures.ScriptedCoordinator`` (a thread of this
process speaking the real key protocol; it notices the dead pid and publishes the failure
flag, as the real coordinator does through the liveness socket's EOF). One GPU per replica
while there are enough; otherwise replicas share a GPU, each with its own ``NCCL_HOSTID``
(NCCL refuses two ranks of one communicator on one GPU of one host; distinct host ids make
it use its socket transport on 127.0.0.1 instead of P2P/NVLink).

The victim launches its all-reduce of iteration ``--kill-iter`` and SIGKILLs itself. Checks
(each prints PASS/FAIL; any FAIL fails the script):

1. every survivor left the failed all-reduce within ``--max-leave-s`` (1 s) of the kill;
2. the failed communicator was aborted (``pg.abort()``, or ``ncclCommShrink`` with
   ``SHRINK_ABORT`` followed by the abort);
3. the next epoch's group was built (``successor``: shrink where NCCL supports it, else a new
   group; both timed, the new group on a scratch prefix) and every all-reduce after it sums
   to the survivors' values;
4. every survivor is the same process as before (pid), and exits with code 0 and no
   ``terminate called``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "tests" / "distributed"))  # live_fixtures (the test driver)

RUN = "gpu-live"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="Gloo and CPU tensors (no GPU)")
    ap.add_argument("--replicas", type=int, default=0, help="0: min(4, GPUs), at least 2")
    ap.add_argument("--victim", type=int, default=-1, help="-1: the last replica")
    ap.add_argument("--kill-iter", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--numel", type=int, default=4 << 20, help="bucket elements (fp32)")
    ap.add_argument("--max-leave-s", type=float, default=1.0)
    ap.add_argument("--poll-slice-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="hard bound on the run")
    ap.add_argument("--no-shrink", action="store_true", help="always build a new group")
    # worker side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gpu", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replicas == 1 or args.replicas < 0:
        ap.error(f"--replicas {args.replicas}: a loss needs at least 2 replicas (0: auto)")
    if not 0 <= args.kill_iter < args.iters:
        ap.error(f"--kill-iter {args.kill_iter} must be in [0, --iters {args.iters})")
    if args.numel < 1:
        ap.error(f"--numel {args.numel} must be at least 1")
    return args


def plan(args: argparse.Namespace, gpus: int) -> tuple[int, int, list[int], bool]:
    """``(replicas, victim, gpu of each replica, shared)``; ``gpus`` 0 on a dry run."""
    replicas = args.replicas or max(2, min(4, gpus))
    victim = args.victim if args.victim >= 0 else replicas - 1
    if not 0 <= victim < replicas:
        raise SystemExit(f"--victim {args.victim} is not a replica of 0..{replicas - 1}")
    if gpus == 0:
        return replicas, victim, [-1] * replicas, False
    return replicas, victim, [r % gpus for r in range(replicas)], replicas > gpus


# -- worker ---------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    from live_fixtures import StoreView

    from lm_resiliency.live.group import CrossReplicaGroup, graveyard_size
    from lm_resiliency.live.keys import Ack
    from lm_resiliency.live.view import EpochFailed

    torch.set_num_threads(1)
    if args.gpu >= 0:
        torch.cuda.set_device(args.gpu)
        device = torch.device("cuda", args.gpu)
    else:
        device = torch.device("cpu")
    replicas, victim = args.replicas, args.victim
    view = StoreView(args.port, RUN, args.replica, replicas)
    kw: dict[str, Any] = {
        "device": device,
        "poll_slice_s": args.poll_slice_s,
        "shrink": not args.no_shrink,
    }
    group = CrossReplicaGroup.build(view, epoch=view.epoch, members=view.members, **kw)
    out: dict[str, Any] = {
        "replica": args.replica,
        "pid": os.getpid(),
        "backend": group.backend,
        "device": str(device),
        "shrink_supported": group.shrink,
        "build0_s": group.build_s,
        "sums": [],
        "changes": [],
    }

    def bucket() -> torch.Tensor:
        return torch.full((args.numel,), float(args.replica + 1), device=device)

    def correct(x: torch.Tensor, members: tuple[int, ...]) -> bool:
        return bool((x == float(sum(m + 1 for m in members))).all().item())

    for it in range(args.iters):
        x = bucket()
        fut = group.allreduce(x)
        if args.replica == victim and it == args.kill_iter:
            view.store().set("test/kill_t", repr(time.time()))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            group.wait(fut)
        except EpochFailed as exc:
            t_out = time.time()
            old = group
            old.abandon(exc.cause)
            record = view.reform(Ack(inc=view.incarnation, committed=it, pid=os.getpid()))
            t_record = time.time()
            group = old.successor(epoch=record.epoch, members=record.members)
            t_built = time.time()
            x = bucket()
            group.wait(group.allreduce(x))  # redo the iteration under the new epoch
            out["changes"].append(
                {
                    "iter": it,
                    "epoch": record.epoch,
                    "members": list(record.members),
                    "cause": exc.cause,
                    "t_out": t_out,
                    "t_record": t_record,
                    "t_built": t_built,
                    "t_first_allreduce": time.time(),
                    "kind": group.rebuild_kind,
                    "rebuild_s": group.build_s,
                    "old_aborted": old._aborted,
                }
            )
        out["sums"].append({"iter": it, "epoch": group.epoch, "ok": correct(x, group.members)})
    if out["changes"]:
        # A new group over the same survivors on a scratch prefix: what the rebuild costs
        # without shrink (collective over the survivors, all at this point).
        fresh = CrossReplicaGroup.build(
            view, epoch=10_000 + group.epoch, members=group.members, **kw
        )
        x = bucket()
        fresh.wait(fresh.allreduce(x))
        out["fresh_build_s"] = fresh.build_s
        out["fresh_ok"] = correct(x, fresh.members)
        fresh.close()
        out["kill_t"] = float(view.store().get("test/kill_t").decode())
    out["graveyard"] = graveyard_size()
    print(json.dumps(out), flush=True)
    time.sleep(0.5)  # exit together with the peers (an abandoned Gloo work fails on EOF)


# -- driver ---------------------------------------------------------------------------------

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
    if not ok:
        failures.append(name)


def drive(args: argparse.Namespace) -> int:
    from live_fixtures import ScriptedCoordinator

    if args.dry_run:
        gpus = 0
    else:
        import torch

        if not torch.cuda.is_available():
            print("SKIP gpu_live_check: no CUDA device (use --dry-run for the Gloo flow)")
            return 0
        gpus = torch.cuda.device_count()
    replicas, victim, gpu_of, shared = plan(args, gpus)
    mode = "dry run: gloo, cpu" if args.dry_run else f"nccl, {gpus} GPU(s)"
    print(
        f"gpu_live_check ({mode}): {replicas} replicas, victim {victim} at iteration "
        f"{args.kill_iter}, bucket {4 * args.numel / 2**20:.1f} MiB"
        + (", GPUs shared (per-process NCCL_HOSTID, socket transport)" if shared else ""),
        flush=True,
    )
    coord = ScriptedCoordinator(RUN, replicas).start()
    procs = []
    try:
        for r in range(replicas):
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(_ROOT / "src"), str(_ROOT / "tests" / "distributed")]
                + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            )
            if shared:
                env.update(NCCL_HOSTID=f"lmr-live-{r}", NCCL_SOCKET_IFNAME="lo")
            cmd = [sys.executable, __file__, "--worker", "--port", str(coord.port)]
            cmd += ["--replica", str(r), "--replicas", str(replicas), "--victim", str(victim)]
            cmd += ["--kill-iter", str(args.kill_iter), "--iters", str(args.iters)]
            cmd += ["--numel", str(args.numel), "--gpu", str(gpu_of[r])]
            cmd += ["--poll-slice-s", str(args.poll_slice_s)]
            cmd += ["--no-shrink"] if args.no_shrink else []
            procs.append(
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
        done = []
        deadline = time.monotonic() + args.timeout_s
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate(timeout=10)
                stderr += f"\n(killed: past --timeout-s {args.timeout_s})"
            done.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        coord.stop()
    return report(args, replicas, victim, procs, done)


def report(
    args: argparse.Namespace,
    replicas: int,
    victim: int,
    procs: list[subprocess.Popen[str]],
    done: list[tuple[int, str, str]],
) -> int:
    check("victim died by SIGKILL", done[victim][0] == -signal.SIGKILL, f"rc={done[victim][0]}")
    survivors = [r for r in range(replicas) if r != victim]
    expected_members = survivors
    results: dict[str, Any] = {"replicas": replicas, "victim": victim, "survivors": {}}
    for r in survivors:
        code, stdout, stderr = done[r]
        clean = code == 0 and "terminate called" not in stderr
        check(f"replica {r} exits cleanly", clean, f"rc={code}")
        if not clean:
            print(stderr[-3000:])
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if not lines:
            check(f"replica {r} reported", False, "no JSON line")
            continue
        rep = json.loads(lines[-1])
        results["survivors"][r] = rep
        check(f"replica {r} same process", rep["pid"] == procs[r].pid, f"pid {rep['pid']}")
        changes = rep["changes"]
        if len(changes) != 1:
            check(f"replica {r} one membership change", False, f"{len(changes)} changes")
            continue
        c = changes[0]
        leave_s = c["t_out"] - rep["kill_t"]
        check(
            f"replica {r} left the all-reduce within {args.max_leave_s:g} s",
            leave_s <= args.max_leave_s,
            f"{1e3 * leave_s:.0f} ms ({c['cause'][:70]})",
        )
        check(f"replica {r} aborted the failed communicator", bool(c["old_aborted"]))
        check(
            f"replica {r} epoch 1 members",
            (c["epoch"], c["members"]) == (1, expected_members),
            f"{c['epoch']} {c['members']}",
        )
        sums_ok = [(s["iter"], s["epoch"], s["ok"]) for s in rep["sums"]] == [
            (i, 0 if i < args.kill_iter else 1, True) for i in range(args.iters)
        ]
        check(
            f"replica {r} all-reduces correct on both epochs",
            sums_ok,
            "" if sums_ok else str(rep["sums"]),
        )
        check(f"replica {r} fresh group correct", bool(rep.get("fresh_ok")))
        kill_t = rep["kill_t"]
        print(
            f"  replica {r} [{rep['backend']} {rep['device']}] ms after the kill: out "
            f"{1e3 * leave_s:.0f}, epoch 1 record {1e3 * (c['t_record'] - kill_t):.0f}, "
            f"group ready {1e3 * (c['t_built'] - kill_t):.0f} ({c['kind']} "
            f"{1e3 * c['rebuild_s']:.1f} ms; a new group {1e3 * rep['fresh_build_s']:.1f} ms; "
            f"first build {1e3 * rep['build0_s']:.0f} ms), first all-reduce done "
            f"{1e3 * (c['t_first_allreduce'] - kill_t):.0f}; shrink supported: "
            f"{rep['shrink_supported']}",
            flush=True,
        )
    results["failures"] = failures
    print(json.dumps({"gpu_live_check": results}, default=str))
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gpu_live_check.json").write_text(json.dumps(results, default=str))
    print("gpu_live_check:", "OK" if not failures else f"FAILED {failures}", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())

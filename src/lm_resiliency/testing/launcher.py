"""Run a function on N real processes joined in a Gloo process group on 127.0.0.1.

Call order (parent): ``run_distributed(fn, world_size)`` -> N child processes
each run ``init_process_group`` -> ``fn(rank, world_size, *args)`` -> report.
The parent owns a ``TCPStore`` on a kernel-chosen port (no free-port race); the
children connect to it as clients.

Guarantees:

* every rank's return value comes back in rank order;
* an exception on any rank is re-raised in the parent as
  :class:`~lm_resiliency.errors.RankFailures` (rank -> type, message, traceback);
* a hard wall-clock ``timeout_s`` for the whole run: ranks still running then are
  sent ``SIGUSR1`` (their Python stacks are dumped), killed, and reported by rank;
* ranks scheduled to die with :func:`kill_point` are expected to vanish and
  report ``None`` without failing the run.

Results travel between the test processes through ``multiprocessing`` queues;
this is test plumbing, never a checkpoint path.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency._killpoints import KILL_ENV
from lm_resiliency.errors import CollectiveTimeout, RankFailure, RankFailures

_HOST = "127.0.0.1"


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: Mapping[str, str],
    pg_timeout_s: float,
    init_pg: bool,
    threads: int,
    stack_file: str,
    queue: Any,
) -> None:
    os.environ.update(env)
    stack_fh = open(stack_file, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    torch.set_num_threads(threads)
    try:
        if init_pg:
            store = dist.TCPStore(_HOST, port, world_size, is_master=False)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor bytes; the queue's own reducer would share them
        # through file descriptors that vanish when this process exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # every failure must reach the parent with its rank
        queue.put((rank, "err", RankFailure.from_exception(rank, exc)))
    finally:
        if init_pg and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    ranks_per_node: int | None = None,
    kill: Mapping[int, str] | None = None,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init_process_group: bool = True,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    ``fn`` and ``args`` must be picklable by reference (module-level function).
    Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    (from ``ranks_per_node``, default: all ranks on one node), ``GROUP_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` like torchrun sets them, plus ``env``
    and ``rank_env[rank]`` (and the parent's ``LM_RESILIENCY_*`` variables).
    ``kill`` maps a rank to the :func:`kill_point`
    name at which it SIGKILLs itself; such ranks return ``None``.

    Returns the per-rank results in rank order. Raises
    :class:`~lm_resiliency.errors.RankFailures` naming every rank that raised,
    died unexpectedly or was still running at ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    per_node = ranks_per_node or world_size
    if world_size % per_node:
        raise ValueError(
            f"ranks_per_node={per_node} does not divide world_size={world_size}; "
            "use a divisor of the world size"
        )
    kill = dict(kill or {})
    ctx = _context()
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    tmp = Path(tempfile.mkdtemp(prefix="lmr-launch-"))
    procs: dict[int, Any] = {}
    for rank in range(world_size):
        child_env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            "MASTER_ADDR": _HOST,
            "MASTER_PORT": str(store.port),
            # The forkserver's children do not see later changes to our environment:
            # forward this library's own settings (e.g. a test's memory folder) explicitly.
            **{k: v for k, v in os.environ.items() if k.startswith("LM_RESILIENCY_")},
            **(env or {}),
            **((rank_env or {}).get(rank, {})),
        }
        if rank in kill:
            child_env[KILL_ENV] = kill[rank]
        p = ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                world_size,
                store.port,
                args,
                child_env,
                pg_timeout_s,
                init_process_group,
                threads_per_rank,
                str(tmp / f"stacks-{rank}.txt"),
                queue,
            ),
            name=f"lmr-rank-{rank}",
        )
        p.start()
        procs[rank] = p

    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            _drain(queue, results, failures)
            for rank, p in procs.items():
                if rank in results or rank in failures or p.is_alive():
                    continue
                _drain(queue, results, failures, wait_s=0.5)  # report may trail the exit
                if rank in results or rank in failures:
                    continue
                if rank in kill:
                    results[rank] = None
                else:
                    failures[rank] = _death(rank, p.exitcode)
            if time.monotonic() > deadline:
                for rank, p in procs.items():
                    if rank not in results and rank not in failures:
                        failures[rank] = _hung(rank, p, timeout_s, tmp / f"stacks-{rank}.txt")
                break
            time.sleep(0.02)
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
        del store
        # The stack dumps were read into the failures above; nothing else lives here.
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        raise RankFailures(f"run_distributed({_name(fn)}, world_size={world_size})", failures)
    return [results[r] for r in range(world_size)]


def _drain(
    queue: Any, results: dict[int, Any], failures: dict[int, RankFailure], wait_s: float = 0.0
) -> None:
    block = wait_s > 0
    while True:
        try:
            rank, status, payload = queue.get(block=block, timeout=wait_s if block else None)
        except queue_mod.Empty:
            return
        block = False
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload


def _death(rank: int, exitcode: int | None) -> RankFailure:
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return RankFailure(rank, "ProcessDied", f"rank {rank} {how} without reporting a result", "")


def _hung(rank: int, p: Any, timeout_s: float, stack_file: Path) -> RankFailure:
    stacks = ""
    if p.pid is not None and p.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            stacks = stack_file.read_text()
        p.kill()
    msg = f"rank {rank} still running after the run's timeout of {timeout_s:.0f}s (hung?)"
    return RankFailure(rank, CollectiveTimeout.__name__, msg, stacks)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _context() -> Any:
    # A fork server that imported torch once, before any thread pool started, forks
    # children in milliseconds instead of re-importing torch (~2 s each under spawn),
    # and avoids forking a parent whose OpenMP/Gloo threads already run.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx

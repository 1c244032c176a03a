"""After an aborted step, MTGS holds nothing that outlives its caller, on 2 real Gloo ranks.

The DDP reducer owns a reference to its process group, so whatever keeps the DDP
model alive keeps the Gloo group (and its worker threads) alive as well, even
after ``destroy_process_group()``. A reference cycle through MTGS left the group
to the cyclic GC, which may first run inside interpreter shutdown; a Gloo worker
that frees a work then needs the GIL, which a finalizing interpreter never gives
back, and the process dies with "terminate called without an active exception"
(the intermittent exit code of the trainer's hook-less backward-exception run).

Each rank here trains 3 steps with the cyclic GC disabled (only reference counting
frees anything) while ``backward_exception@1:2`` aborts step 2 once, drops its
references, and reports whether the model was freed and which Gloo threads are
left after ``destroy_process_group()``. One collection runs before the steps:
constructing the first DDP model of a process leaves cyclic garbage of torch's own
(an import's traceback whose frames hold the model) that only the GC frees.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT, synthetic_batches
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS, MTGSConfig

_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
_TASKS = Path("/proc/self/task")


def _gloo_threads() -> list[str]:
    """Names of this process's native threads that belong to Gloo (Linux)."""
    names = []
    for task in _TASKS.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while we listed them
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _closure(ddp: DDP, data: SyntheticTokens) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        x, y = next(data)
        loss: torch.Tensor = ddp(x, y)
        return loss

    return closure


def _abort_then_release(rank: int, world: int, vote_in_hook: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets: the backward stops half-way
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = synthetic_batches(1, 4, 16, 64, rank=rank, world_size=world)
    faults = FaultInjector("backward_exception@1:2", rank=rank)
    faults.arm()
    faults.install(model, opt)
    txn = MTGS(
        ddp, opt, config=MTGSConfig(vote_in_hook=vote_in_hook), data_state=data, faults=faults
    )
    closure = _closure(ddp, data)
    gc.collect()  # torch's garbage from constructing DDP (see the module doc), not ours
    gc.disable()  # from here on, what holds the model must not be hidden by a collection
    try:
        results = [txn.step(closure) for _ in range(3)]
        txn.close()
        aborts = {r.step: [(a.phase, a.reasons) for a in r.aborts] for r in results if r.aborts}
        model_ref = weakref.ref(ddp)
        del txn, ddp, closure, results, faults, opt, model, data
        freed = model_ref() is None
        before = _gloo_threads()
        dist.destroy_process_group()
        return {"aborts": aborts, "freed": freed, "before": before, "after": _gloo_threads()}
    finally:
        gc.enable()


@pytest.mark.skipif(not _TASKS.is_dir(), reason="lists native threads through /proc (Linux)")
@pytest.mark.parametrize("vote_in_hook", [False, True], ids=["hookless", "hook"])
def test_after_an_aborted_step_destroy_process_group_stops_the_gloo_threads(
    vote_in_hook: bool,
) -> None:
    out = run_distributed(
        _abort_then_release, 2, args=(vote_in_hook,), timeout_s=180, pg_timeout_s=60
    )
    for rank, res in enumerate(out):
        assert res["aborts"] == {2: [("vote", {1: ("backward_exception",)})]}, rank
        assert res["freed"], (
            f"rank {rank}: the DDP model outlived every reference to it after an aborted "
            "step (a reference cycle through MTGS keeps it, its reducer and its process group)"
        )
        assert res["before"], f"rank {rank}: no Gloo thread found before the group was destroyed"
        assert res["after"] == [], (
            f"rank {rank}: Gloo threads {res['after']} still run after destroy_process_group()"
        )

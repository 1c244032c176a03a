"""A rank killed or hung mid-step: survivors abort within the timeout and apply nothing.

The survivors' collective fails (connection reset for a killed peer, the
process-group timeout for a stopped one); they keep the state from before the
step (restoring the shadow if they had already updated) and end with a clear
error naming the step, so the launcher restarts the job.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.errors import CollectiveTimeout, ResiliencyError, StepAborted
from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.testing import kill_point, run_distributed
from lm_resiliency.transactions import MTGS, MTGSConfig

_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[np.ndarray]:
    out = [p.detach().numpy().copy() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state.get(p, {})):
            out.append(opt.state[p][key].detach().numpy().copy())
    return out


def _train_until_failure(rank: int, world: int, where: str, faults: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = synthetic_batches(1, 4, 16, 64, rank=rank, world_size=world)
    injector = None
    if faults:
        injector = FaultInjector(faults, rank=rank, sigstop_resume_s=6.0)
        injector.arm()
        injector.install(model, opt)
    txn = MTGS(ddp, opt, config=MTGSConfig(collective_timeout_s=3.0), faults=injector)
    params = list(model.parameters())

    def in_backward(grad: torch.Tensor) -> None:
        if txn.committed_steps + 1 == 3:
            kill_point("mid-backward")

    params[len(params) // 2].register_hook(in_backward)
    opt.register_step_post_hook(
        lambda *_: kill_point("after-update") if txn.committed_steps + 1 == 3 else None
    )

    def closure() -> torch.Tensor:
        x, y = next(data)
        loss: torch.Tensor = ddp(x, y)
        return loss

    before = None
    for _ in range(4):
        before = _state(model, opt)
        try:
            txn.step(closure)
        except (StepAborted, CollectiveTimeout) as exc:
            return {
                "type": type(exc).__name__,
                "message": str(exc),
                "step": txn.committed_steps + 1,
                "unchanged": all(
                    np.array_equal(a, b) for a, b in zip(before, _state(model, opt), strict=True)
                ),
            }
    return {"type": None, "step": txn.committed_steps}


def test_rank_killed_mid_backward_survivor_aborts_the_step_and_applied_nothing() -> None:
    out = run_distributed(
        _train_until_failure,
        2,
        args=("mid-backward", ""),
        kill={1: "mid-backward"},
        timeout_s=120,
        pg_timeout_s=30,
    )
    assert out[1] is None  # killed
    survivor = out[0]
    assert survivor["type"] == "StepAborted"
    assert survivor["step"] == 3
    assert (
        "rank 0: step 3 aborted: the backward pass (gradient all-reduce) lost a peer"
        in (survivor["message"])
    )
    assert "no surviving rank applied step 3" in survivor["message"]
    assert survivor["unchanged"]


def test_rank_killed_after_its_update_survivor_rolls_back_its_own_update() -> None:
    out = run_distributed(
        _train_until_failure,
        2,
        args=("after-update", ""),
        kill={1: "after-update"},
        timeout_s=120,
        pg_timeout_s=30,
    )
    survivor = out[0]
    assert survivor["type"] == "StepAborted"
    assert survivor["step"] == 3
    assert "the commit confirmation all-reduce lost a peer" in survivor["message"]
    # rank 0 had applied step 3 before the confirmation failed: the shadow undid it
    assert survivor["unchanged"]


def test_stopped_rank_makes_the_survivor_time_out_without_applying_the_step() -> None:
    out = run_distributed(
        _train_until_failure,
        2,
        args=("", "sigstop@1:3"),
        timeout_s=120,
        pg_timeout_s=3,
    )
    survivor = out[0]
    assert survivor["type"] == "CollectiveTimeout"
    assert survivor["step"] == 3
    assert (
        "step 3 aborted: the backward pass (gradient all-reduce) timed out" in survivor["message"]
    )
    assert "peers in this collective: ranks [1]" in survivor["message"]
    assert survivor["unchanged"]
    # the stopped rank resumed later, found its peer gone and failed too, cleanly
    assert out[1]["type"] in ("StepAborted", "CollectiveTimeout")
    assert out[1]["step"] == 3


def _step_without_sync(rank: int, world: int, first_step_ok: bool) -> str:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = synthetic_batches(1, 4, 16, 64, rank=rank, world_size=world)
    txn = MTGS(ddp, opt, config=MTGSConfig(collective_timeout_s=10.0))

    def closure() -> torch.Tensor:
        x, y = next(data)
        loss: torch.Tensor = ddp(x, y)
        return loss

    if first_step_ok:
        txn.step(closure)
    try:
        with ddp.no_sync():  # a usage error: no gradient all-reduce, so no vote
            txn.step(closure)
    except ResiliencyError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_step_without_gradient_sync_is_a_usage_error_not_a_lost_peer() -> None:
    # The hook never ran in this step: whatever earlier steps did, that is a usage
    # error (DDP.no_sync()), never reported as a collective failure.
    for first_step_ok in (False, True):
        out = run_distributed(_step_without_sync, 2, args=(first_step_ok,), timeout_s=120)
        for message in out:
            assert message.startswith("ResiliencyError: step"), message
            assert "carried no vote" in message and "no_sync" in message

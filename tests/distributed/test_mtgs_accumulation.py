"""MTGS with gradient accumulation on real Gloo ranks: micro-batches under DDP.no_sync().

Each step accumulates 3 micro-batches (the first two under ``no_sync()``, the
last one synchronised). The health of every micro-batch travels in the vote
carried by the last micro-batch's all-reduce; an abort retries the whole
accumulated step with the same batches and random numbers. Reference: plain
DDP accumulating the same micro-batches without MTGS.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS, MTGSConfig

_STEPS, _MICRO = 5, 3
_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[np.ndarray]:
    out = [p.detach().numpy().copy() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state.get(p, {})):
            out.append(opt.state[p][key].detach().numpy().copy())
    return out


def _train(rank: int, world: int, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = synthetic_batches(1, 4, 16, 64, rank=rank, world_size=world)
    torch.manual_seed(5 + rank)
    if mode == "baseline":
        for _ in range(_STEPS):
            for k in range(_MICRO):
                x, y = next(data)
                if k < _MICRO - 1:
                    with ddp.no_sync():
                        (ddp(x, y) / _MICRO).backward()
                else:
                    (ddp(x, y) / _MICRO).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"state": _state(model, opt)}

    txn = MTGS(ddp, opt, config=MTGSConfig(), data_state=data)
    if mode == "faulty":
        txn.faults = FaultInjector("nan_grad@1:2", rank=rank)  # micro-batch 0's backward
        txn.faults.arm()
        txn.faults.install(model, opt)
    fired: list[tuple[int, int]] = []

    def closure(k: int) -> torch.Tensor:
        x, y = next(data)
        step = txn.committed_steps + 1
        if mode == "faulty" and (rank, step, k) == (0, 3, 1) and (step, k) not in fired:
            fired.append((step, k))
            raise RuntimeError("injected: micro-batch 1 of step 3 failed on rank 0")
        loss = ddp(x, y) / _MICRO
        if mode == "faulty" and (rank, step, k) == (1, 4, 0) and (step, k) not in fired:
            fired.append((step, k))
            loss = loss * float("inf")  # a non-finite loss in the first micro-batch
        return loss

    records = []
    for _ in range(_STEPS):
        r = txn.step(closure, micro_batches=_MICRO)
        records.append({"step": r.step, "attempts": r.attempts, "reasons": r.reasons})
    return {"state": _state(model, opt), "records": records, "collectives": txn.collectives}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    return {m: run_distributed(_train, 2, args=(m,), timeout_s=120) for m in
            ("baseline", "mtgs", "faulty")}  # fmt: skip


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_accumulated_transactions_equal_plain_ddp_accumulation(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        assert _equal(runs["mtgs"][rank]["state"], runs["baseline"][rank]["state"])
        assert [r["attempts"] for r in runs["mtgs"][rank]["records"]] == [1] * _STEPS


def test_the_vote_rides_on_the_last_micro_batch_with_no_extra_collective(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        counts = runs["mtgs"][rank]["collectives"]
        assert counts["votes_in_buckets"] == _STEPS  # one vote per step, in the last bucket
        assert counts["explicit_votes"] == 0
        assert counts["fallback_allreduces"] == 0
        assert counts["commit_confirmations"] == _STEPS  # the two-phase commit's own


def test_a_fault_in_any_micro_batch_aborts_and_retries_the_whole_step(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        records = {r["step"]: r for r in runs["faulty"][rank]["records"]}
        assert records[1]["attempts"] == 1
        assert records[2] == {"step": 2, "attempts": 2, "reasons": {1: ("nonfinite_grad",)}}
        assert records[3] == {"step": 3, "attempts": 2, "reasons": {0: ("forward_exception",)}}
        assert records[4]["attempts"] == 2
        assert "nonfinite_loss" in records[4]["reasons"][1]
        assert records[5]["attempts"] == 1
        # same batches, same random numbers: the result is the fault-free one
        assert _equal(runs["faulty"][rank]["state"], runs["baseline"][rank]["state"])
    # only rank 0 failed mid-step: it completed its peers' all-reduces with zero buckets
    assert runs["faulty"][0]["collectives"]["fallback_allreduces"] > 0
    assert runs["faulty"][1]["collectives"]["fallback_allreduces"] == 0

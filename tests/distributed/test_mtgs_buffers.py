"""MTGS with module buffers: an aborted attempt's forward changed them, the retry does not
see that. 2 real Gloo ranks, a BatchNorm MLP under DDP (its statistics and batch counter
change in place in every forward; DDP broadcasts rank 0's at the start of each forward):
a NaN gradient on rank 1 at step 3 is aborted and retried, and the final parameters,
optimizer state *and buffers* equal a fault-free run's bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.faults import FaultInjector
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS

_STEPS = 5


def _train(rank: int, world: int, faults: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = [0]

    def closure() -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * txn.committed_steps + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        step[0] += 1
        return nn.functional.mse_loss(ddp(x), y)

    injector = None
    if faults:
        injector = FaultInjector(faults, rank=rank)
        injector.arm()
        injector.install(model, opt)
    txn = MTGS(ddp, opt, faults=injector)
    attempts = [txn.step(closure).attempts for _ in range(_STEPS)]
    txn.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        state.update({f"opt/{i}/{k}": v.detach().clone() for k, v in st.items()})
    return {"attempts": attempts, "forwards": step[0], "state": state}


def test_a_retried_step_starts_from_the_buffers_before_its_failed_attempt() -> None:
    reference = run_distributed(_train, 2, args=(None,), timeout_s=120)
    faulty = run_distributed(_train, 2, args=("nan_grad@1:3",), timeout_s=120)
    for rank in range(2):
        ref, out = reference[rank], faulty[rank]
        assert out["attempts"] == [1, 1, 2, 1, 1]
        assert out["forwards"] == ref["forwards"] + 1  # the failed attempt's forward ran
        assert set(out["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            assert torch.equal(out["state"][key], value), (rank, key)
        assert int(out["state"]["1.num_batches_tracked"]) == _STEPS

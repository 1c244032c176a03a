"""DDP and FSDP2 with buffers: the capture of step N holds step N's buffers on every rank.

DDP broadcasts rank 0's buffers into every rank's at the start of each forward
(``broadcast_buffers=True``, its default) and BatchNorm updates its statistics
in place inside it: both happen after ``optimizer.step()`` of step N, while the
capture of step N is still being copied. 2 real Gloo ranks, the plain loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.testing import run_distributed


def _rank(rank: int, world: int, folder: str) -> list[int]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)), nn.BatchNorm1d(512))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    config = InMemoryCkptConfig(disk_folder=folder, run_id="ddp-buffers", disk_flush_interval=0)
    bn = model[4]
    wrong: list[int] = []
    with enable_resiliency(ddp, opt, interval=1, config=config) as resiliency:
        for step in range(1, 7):
            g = torch.Generator().manual_seed(100 * step + rank)
            ddp(torch.randn(8, 512, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected: dict[str, Any] = {
                "4.running_mean": bn.running_mean.clone(),
                "4.running_var": bn.running_var.clone(),
            }
            ddp(torch.randn(8, 512, generator=g)).sum().backward()  # broadcast + BN update
            resiliency.manager.maybe_wait()
            saved = resiliency.manager.load(step)["adapter"]["model"]
            if not all(torch.equal(saved[k], v) for k, v in expected.items()):
                wrong.append(step)
            opt.zero_grad()
    return wrong


def test_ddp_buffer_broadcast_and_batchnorm_do_not_tear_the_capture(tmp_path) -> None:
    assert run_distributed(_rank, 2, args=(str(tmp_path),), timeout_s=120) == [[], []]


class _Prefetched:
    """A large per-rank ``state`` object (a prefetched batch): its copy comes before the
    adapter's per-rank part, so the next forward runs while the buffers wait to be copied."""

    def __init__(self) -> None:
        self.batch = torch.zeros(32 * 2**20)  # 128 MiB

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = state["batch"]


def _fsdp_rank(rank: int, world: int, folder: str) -> list[int]:
    # FSDP2 keeps buffers unsharded on every rank; the adapter's per-rank part holds them.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)), nn.BatchNorm1d(512))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model[:4]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = InMemoryCkptConfig(disk_folder=folder, run_id="fsdp-buffers", disk_flush_interval=0)
    bn = model[4]
    wrong: list[int] = []
    state = {"prefetched": _Prefetched()}
    with enable_resiliency(model, opt, interval=1, config=config, state=state) as resiliency:
        for step in range(1, 7):
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(8, 512, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected = {
                "4.running_mean": bn.running_mean.clone(),
                "4.running_var": bn.running_var.clone(),
            }
            model(torch.randn(8, 512, generator=g)).sum().backward()  # the BN update
            resiliency.manager.maybe_wait()
            saved = resiliency.manager.load(step)["rank"]["adapter"]["buffers"]
            if not all(torch.equal(saved[k], v) for k, v in expected.items()):
                wrong.append(step)
            opt.zero_grad()
    return wrong


def test_fsdp2_batchnorm_does_not_tear_the_capture(tmp_path) -> None:
    assert run_distributed(_fsdp_rank, 2, args=(str(tmp_path),), timeout_s=120) == [[], []]

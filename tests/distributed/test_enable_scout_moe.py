"""MoE through the front door: ``ScoutConfig(catalog=...)`` certifies by cycles, and the plain
loop's ``save_durable`` (the partner of ``load_fallback``) writes each durable candidate
and, having ``verified``/``rejected`` methods, is told each one's fate.

4 DDP ranks, a top-1 routed MoE, ``enable_resiliency(..., interval=5)`` with a dynamic
catalog of K = 2 expert shapes checked every 5 steps; the dense recipes are checked every
step so that their coverage keeps up (docs/scout.md, "Certification"). The table, end to
end: step 10 closes the first accepted cycle and becomes the CANDIDATE (durable
candidate written); step 20 closes the next, so 10 becomes RECOVERY_VERIFIED and 20 the
next CANDIDATE (written); rank 3 computes every expert wrong from step 22, SCOUT finds
it before step 25, candidate 20 is rejected on every rank and 25 and 30 are skipped. The
restarted job is told nothing and recovers step 10 in verified mode, bit for bit; the
durable candidate of 10 holds the same model state.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scout_fixtures import TinyMoE, accepted
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lm_resiliency import InMemoryCkptConfig, RecoveryMode, ScoutConfig, enable_resiliency
from lm_resiliency.detection import DynamicCatalog, RecipeClass, ScoutStatus
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.testing import run_distributed

pytestmark = pytest.mark.slow  # two 4-rank jobs: about two minutes on the shared 2-core host

INTERVAL, ONSET, STEPS = 5, 22, 30


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _batches(rank: int, world: int):  # a real loader: a dataset, a sampler, epochs
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(960, 8, generator=g), torch.randn(960, 2, generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=24, sampler=sampler)
    for epoch in range(1000):
        sampler.set_epoch(epoch)
        yield from loader


def _job(rank: int, world: int, tmp: str, first: bool) -> dict:
    torch.manual_seed(0 if first else 99)  # the restart starts from other weights
    model = TinyMoE()
    ddp = DDP(model, find_unused_parameters=True)  # top-1 routing leaves experts unused
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    durable = Path(tmp) / "durable"
    written: list[int] = []
    fates: list[tuple[str, int]] = []

    class SaveDurable:  # the framework's durable candidate, told each one's fate
        def __call__(self, step: int) -> None:
            path = durable / f"candidate-{step}-rank{rank}.safetensors"
            save_file(model.state_dict(), str(path))
            written.append(step)

        def verified(self, step: int) -> None:
            fates.append(("verified", step))

        def rejected(self, step: int) -> None:
            fates.append(("rejected", step))

    save_durable = SaveDurable()

    durable.mkdir(exist_ok=True)
    every_step = RecipeClass(interval=1)
    scout = ScoutConfig(
        catalog=DynamicCatalog(model.experts, shapes=[[(8, 16)], [(16, 16)]]),
        dense=every_step,
        optimizer=every_step,
        dynamic=RecipeClass(interval=INTERVAL),
    )
    cfg = InMemoryCkptConfig(disk_folder=tmp, disk_flush_interval=0, run_id="moe-front-door")
    h = enable_resiliency(
        ddp, opt, interval=INTERVAL, config=cfg, scout=scout, save_durable=save_durable
    )
    d = h.last_recovery.decision
    out: dict = {"start": h.start_step, "decision": (d.failure_kind.value, d.mode, d.step)}
    out["restored"] = _digest({**model.state_dict()})
    if not first:
        h.close()
        return out
    faults = ComputeFaults(
        [PersistentSDC(rank=3, module=e, from_step=ONSET) for e in model.experts], rank=rank
    )
    faults.arm()
    faults.install(opt)
    table, captured = {}, {}
    batches = _batches(rank, world)
    for step in range(1, STEPS + 1):  # the plain loop
        x, y = next(batches)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % INTERVAL == 0:
            captured[step] = _digest(model.state_dict())
        if step > 1 and (step - 1) % INTERVAL == 0:
            # The pipelined verdict (the default): the check at a boundary resolves in the
            # next step's pre-step hook, so its row is read one step later.
            h.manager.trust.wait()
            last = h.last_scout
            table[step - 1] = (
                accepted(last.status),
                h.scout.certifier.candidate,
                h.manager.find_latest(RecoveryMode.RECOVERY_VERIFIED),
            )
    h.manager.wait_persisted(timeout_s=60)
    status = h.manager.store().sidecar.status()
    out |= {
        "table": table,
        "captured": captured,
        "written": written,
        "fates": fates,
        "rejected": [s for s, _ in status.rejected],
        "skipped": h.stats.skipped,
        "durable10": _digest(load_file(str(durable / f"candidate-10-rank{rank}.safetensors"))),
    }
    return out  # no close(): the job stops after the SDC, as a crashed worker's would


def test_moe_candidate_verified_rejected_through_enable_resiliency(tmp_path: Path) -> None:
    job = run_distributed(_job, 4, args=(str(tmp_path), True), timeout_s=300)
    h = ScoutStatus.HEALTHY
    for rank, o in enumerate(job):
        t = o["table"]
        assert [t[s] for s in (5, 10, 15, 20)] == [
            (h, None, None), (h, 10, None), (h, 10, None), (h, 20, 10),
        ], f"rank {rank}: {t}"  # fmt: skip
        assert t[25][0] is ScoutStatus.SDC and t[25][1:] == (None, 10), f"rank {rank}: {t}"
        assert o["written"] == [10, 20]  # a durable candidate at each first/next cycle
        assert o["fates"] == [("verified", 10), ("rejected", 20)]  # told at 20 and 25
        assert o["rejected"] == [20]  # the SDC rejected the candidate on every rank
        assert o["skipped"] >= 2  # 25 and 30 were not captured
        assert o["durable10"] == o["captured"][10]  # the durable candidate is that state

    again = run_distributed(_job, 4, args=(str(tmp_path), False), timeout_s=300)
    for rank, o in enumerate(again):
        assert o["decision"] == ("sdc", RecoveryMode.RECOVERY_VERIFIED, 10), o
        assert o["restored"] == job[rank]["captured"][10], f"rank {rank}: not bit-identical"

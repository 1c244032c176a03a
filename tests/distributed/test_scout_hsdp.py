"""SCOUT on HSDP (FSDP2 over a 2 x 2 replicate x shard mesh), 4 real Gloo ranks.

The comparison groups are the replicate dimension ([0, 2] and [1, 3]); every
replayed block all-gathers its shards inside its forward, so both groups must
replay the same block at the same check: the rotation is the same in every group
by construction (it depends only on the check's sequence number and the blocks
disabled job-wide, and FSDP2 makes every rank call the same modules), and the
job would hang otherwise. Three jobs run one after the other in the same
processes: without SCOUT, with SCOUT (every check healthy, the training
bit-identical to the first job: the replays leave it untouched), and with a
persistent SDC on rank 3 (its group of two reports it inconclusive at the first
check of the faulty block; every rank blocks that capture and the ones after).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fsdp_models import sharded_mlp as _model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lm_resiliency import InMemoryCkptConfig, ScoutConfig, enable_resiliency
from lm_resiliency.detection.result import CHECK_EVENT
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.models import SyntheticTokens
from lm_resiliency.telemetry import EventLog
from lm_resiliency.testing import run_distributed

_INTERVAL, _STEPS, _ONSET = 2, 12, 5


def _train(rank: int, world: int, folder: str, mode: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = SyntheticTokens(3, 4, 8, 32, rank=rank, world_size=world)
    torch.manual_seed(20 + rank)
    config = InMemoryCkptConfig(
        disk_folder=f"{folder}/{mode}", run_id=f"hsdp-scout-{mode}", disk_flush_interval=0
    )
    scout = None if mode == "plain" else ScoutConfig()
    resiliency = enable_resiliency(
        model, opt, interval=_INTERVAL, state={"loader": loader}, config=config, scout=scout
    )
    if mode == "sdc":
        sdc = PersistentSDC(rank=3, module=model[5], from_step=_ONSET)
        faults = ComputeFaults([sdc], rank=rank)
        faults.arm()
        faults.install(opt)
    # Every check's result as it resolves (pipelined: a boundary's verdict is known at the
    # next step's pre-step hook, or at close for the last one).
    events = EventLog(rank=rank)
    if resiliency.scout is not None:
        resiliency.scout.events = events
    for _ in range(resiliency.start_step + 1, _STEPS + 1):  # the plain loop
        inputs, targets = next(loader)
        nn.functional.cross_entropy(model(inputs).view(-1, 32), targets.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    params = {
        n: p.to_local().detach().clone().view(-1).view(torch.uint8).numpy().tobytes()
        for n, p in model.named_parameters()
    }
    latest = resiliency.manager.find_latest()
    resiliency.close()
    checks = [
        (e["step"], e["status"], e["recipe"], e["reason"])
        for e in events.records
        if e["event"] == CHECK_EVENT
    ]
    out = {
        "checks": checks,
        "captures": resiliency.stats.captures,
        "skipped": resiliency.stats.skipped,
        "latest": latest,
        "params": params,
    }
    return out


def _jobs(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {mode: _train(rank, world, folder, mode) for mode in ("plain", "clean", "sdc")}


def test_hsdp_replays_agree_leave_training_untouched_and_catch_an_sdc(tmp_path: Path) -> None:
    ranks = run_distributed(_jobs, 4, args=(str(tmp_path),), timeout_s=300)
    checks_at = list(range(_INTERVAL, _STEPS + 1, _INTERVAL))
    for rank, jobs in enumerate(ranks):
        clean, sdc = jobs["clean"], jobs["sdc"]
        assert [c[0] for c in clean["checks"]] == checks_at, rank
        assert all(c[1] == "healthy" for c in clean["checks"]), (rank, clean["checks"])
        # three blocks (the embedding and the two linear layers), rotated in every group alike
        recipes = [c[2] for c in clean["checks"]]
        assert recipes == [recipes[i % 3] for i in range(len(recipes))], recipes
        assert len(set(recipes)) == 3, recipes
        assert clean["captures"] == len(checks_at) and clean["skipped"] == 0
        assert clean["params"] == jobs["plain"]["params"], rank  # replays left training alone
        # the SDC in model[5] (the third block) from step 5: found at step 6 by group [1, 3]
        statuses = {step: status for step, status, _, _ in sdc["checks"]}
        assert all(statuses[s] == "healthy" for s in (2, 4)), sdc["checks"]
        assert statuses[6] == "inconclusive", sdc["checks"]
        reason = next(r for s, _, _, r in sdc["checks"] if s == 6)
        assert "[1, 3]" in reason and "inconclusive" in reason, reason
        # 2 and 4 kept; 6 launched before its verdict, held and discarded unpublished when it
        # resolved at step 7's pre-step hook (counted as skipped), every later one latched
        assert (sdc["captures"], sdc["skipped"]) == (2, len(checks_at) - 2), sdc
        assert sdc["latest"] == 4 and clean["latest"] == checks_at[-1], (sdc, clean)
    # the replicas along the replicate dimension still hold identical shards
    assert ranks[0]["clean"]["params"] == ranks[2]["clean"]["params"]
    assert ranks[1]["clean"]["params"] == ranks[3]["clean"]["params"]

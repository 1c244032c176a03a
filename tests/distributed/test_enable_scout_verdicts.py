"""Through enable_resiliency with the pipelined verdict (the default), every check's verdict,
a capture boundary's included, is ``handle.last_scout`` after the next ``optimizer.step()``.

3 DDP ranks run the plain loop (tiny GPT, capturing every 5 steps) with a persistent SDC
on rank 1's first block from step 12, checking every step or every 2 steps. A boundary's
check is posted at the boundary and resolves at the next pre-step hook. Before the fix
the check between boundaries ran synchronously in the same ``optimizer.step()`` (its
post-step hook), resolving the boundary's verdict first and replacing it at once: the
caller never saw the verdict of a boundary followed by a check (with every step: none of
5, 10, 15, so neither the clean boundaries nor the SDC found at 15). The product's own
record of every resolved check (the ``scout.check`` events) is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scout_fixtures import GPT, accepted
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, ScoutConfig, enable_resiliency
from lm_resiliency.detection import ScoutStatus
from lm_resiliency.detection.result import CHECK_EVENT
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.models import SyntheticTokens, TinyGPT
from lm_resiliency.persistence.trust import TrustStatus
from lm_resiliency.telemetry import EventLog
from lm_resiliency.testing import run_distributed

INTERVAL, ONSET, STEPS = 5, 12, 16


def _job(rank: int, world: int, tmp: str, every: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(0, 4, GPT.block_size, GPT.vocab_size, rank=rank, world_size=world)
    torch.manual_seed(7919 + rank)
    cfg = InMemoryCkptConfig(
        disk_folder=tmp, disk_flush_interval=0, run_id=f"verdicts-{every}", signal_flush=False
    )
    h = enable_resiliency(
        ddp,
        opt,
        interval=INTERVAL,
        config=cfg,
        state={"data": data},
        scout=ScoutConfig(interval=every),
    )
    assert h.scout is not None
    events = EventLog(rank=rank)
    h.scout.events = events
    faults = ComputeFaults(
        [PersistentSDC(rank=1, module=model.blocks[0], from_step=ONSET)], rank=rank
    )
    faults.arm()
    faults.install(opt)
    seen: dict[int, tuple[str, list[int]]] = {}
    newest_after: dict[int, int | None] = {}  # step -> last_scout.step after its optimizer.step
    for step in range(1, STEPS + 1):  # the plain loop, reading the verdicts as a user would
        inputs, targets = next(data)
        ddp(inputs, targets).backward()
        opt.step()
        opt.zero_grad()
        last = h.last_scout
        newest_after[step] = None if last is None else last.step
        if last is not None:
            seen[last.step] = (accepted(last.status).value, list(last.faulty_ranks))
    trust = {s: h.manager.trust.trust_of(s).value for s in (5, 10)}
    h.close()
    last = h.last_scout
    assert last is not None
    seen[last.step] = (accepted(last.status).value, list(last.faulty_ranks))
    resolved = {
        e["step"]: (accepted(ScoutStatus(e["status"])).value, list(e["faulty_ranks"]))
        for e in events.records
        if e["event"] == CHECK_EVENT
    }
    return {"seen": seen, "resolved": resolved, "newest_after": newest_after, "trust": trust}


@pytest.mark.parametrize("every", [1, 2])
def test_every_verdict_is_last_scout_after_the_next_step(tmp_path: Path, every: int) -> None:
    out = run_distributed(_job, 3, args=(str(tmp_path), every), timeout_s=240)
    for rank, o in enumerate(out):
        resolved = o["resolved"]
        checks = sorted(resolved)
        assert {5, 10, 15} <= set(checks), checks  # every boundary was checked
        assert all(s % every == 0 or s % INTERVAL == 0 for s in checks), checks
        # the caller saw every resolved check, with the same verdict
        assert o["seen"] == resolved, f"rank {rank}: {o['seen']} != {resolved}"
        # ... each one step later: after step t, the newest check before t
        for step, newest in o["newest_after"].items():
            before = [s for s in checks if s < step]
            assert newest == (before[-1] if before else None), (rank, step, newest)
        assert resolved[5] == resolved[10] == ("healthy", [])
        assert o["trust"][5] != TrustStatus.UNVERIFIED.value  # certified when resolved
        if every == 1:  # the rotation reaches the faulty block at 15 (test_enable_scout.py)
            assert resolved[15] == ("sdc", [1]), resolved

"""SCOUT through enable_resiliency: a persistent SDC blocks the captures after it, and the
restarted job recovers the last certified step by itself, bit for bit.

SCOUT checks every step (``ScoutConfig(interval=1)``): the GPT's six blocks are five
recipes, and step 10 is verified once each was checked clean at or after it (step 14),
before the onset's first check of the faulty layer (15)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from scout_fixtures import accepted
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, RecoveryMode, ScoutConfig, enable_resiliency
from lm_resiliency.detection import ScoutStatus
from lm_resiliency.detection.result import CHECK_EVENT
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT
from lm_resiliency.telemetry import EventLog
from lm_resiliency.testing import run_distributed

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
INTERVAL, ONSET, STEPS = 5, 12, 20


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values()]:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _job(rank: int, world: int, tmp: str, faulty: bool) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(0, 4, GPT.block_size, GPT.vocab_size, rank=rank, world_size=world)
    torch.manual_seed(7919 + rank)
    cfg = InMemoryCkptConfig(
        disk_folder=tmp, disk_flush_interval=0, run_id="enable-scout", signal_flush=False
    )
    h = enable_resiliency(
        ddp, opt, interval=INTERVAL, config=cfg, state={"data": data}, scout=ScoutConfig(interval=1)
    )
    out: dict = {"start": h.start_step, "restored": _digest(model, opt)}
    if h.last_recovery.decision is not None:
        d = h.last_recovery.decision
        out["decision"] = (d.failure_kind.value, d.mode, d.step)
    if not faulty:
        h.close()
        return out
    faults = ComputeFaults(
        [PersistentSDC(rank=1, module=model.blocks[0], from_step=ONSET)], rank=rank
    )
    faults.arm()
    faults.install(opt)
    # Every check's result as it resolves (pipelined: a boundary's verdict is known at the
    # next step's pre-step hook, so h.last_scout after opt.step() is an older check's).
    events = EventLog(rank=rank)
    assert h.scout is not None
    h.scout.events = events
    digests = {}
    for step in range(h.start_step + 1, STEPS + 1):  # the plain loop
        inputs, targets = next(data)
        ddp(inputs, targets).backward()
        opt.step()
        opt.zero_grad()
        if step % INTERVAL == 0:
            digests[step] = _digest(model, opt)
    h.manager.wait_persisted()
    statuses = {
        e["step"]: (ScoutStatus(e["status"]), tuple(e["faulty_ranks"]))
        for e in events.records
        if e["event"] == CHECK_EVENT
    }
    out.update(
        digests=digests,
        statuses=statuses,
        captures=h.stats.captures,
        skipped=h.stats.skipped,
    )
    return out  # no close(): the process ends as a crashed worker's would


def test_sdc_blocks_captures_and_the_restart_recovers_the_certified_step(tmp_path: Path) -> None:
    first = run_distributed(_job, 3, args=(str(tmp_path), True), timeout_s=240)
    for o in first:
        assert o["start"] == 0
        for step in (5, 10):
            status, faulty = o["statuses"][step]
            assert (accepted(status), faulty) == (ScoutStatus.HEALTHY, ())
        # the first check after the onset; the majority of 3 names rank 1
        assert o["statuses"][15] == (ScoutStatus.SDC, (1,))
        # 15 launched before its verdict, held and discarded at step 16's pre-step hook
        # (counted as skipped); 20 latched
        assert (o["captures"], o["skipped"]) == (2, 2)
    again = run_distributed(_job, 3, args=(str(tmp_path), False), timeout_s=240)
    for rank, o in enumerate(again):
        assert o["decision"] == ("sdc", RecoveryMode.RECOVERY_VERIFIED, 10)
        assert o["start"] == 10
        assert o["restored"] == first[rank]["digests"][10], f"rank {rank}: not bit-identical"

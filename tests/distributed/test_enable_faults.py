"""``enable_resiliency(faults=...)``: a user's fault injector is attached through the front door.

2 real Gloo ranks, DDP and MTGS. An armed injector given as ``faults=`` fires
at its scheduled step (rank 1's gradient turns NaN at step 2), MTGS aborts and
retries that step on both ranks, and training goes on; ``close()`` removes the
hooks ``enable_resiliency`` installed. An injector that could never fire is
refused before anything is built: without ``mtgs=`` (nothing would tell it the
step), not armed, or built for another rank. (The torchrun case, a SIGKILL
survived through ``faults=``, is ``tests/faults/test_enable_mtgs.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import ConfigError, InMemoryCkptConfig, MTGSConfig, enable_resiliency
from lm_resiliency.faults import ARM_ENV, FaultInjector
from lm_resiliency.models import SyntheticTokens
from lm_resiliency.testing import run_distributed


def _refusal(call: Any) -> str:
    try:
        call()
    except ConfigError as e:
        return str(e)
    return "accepted"


def _rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Embedding(32, 8), nn.Flatten(), nn.Linear(64, 32 * 8)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = SyntheticTokens(0, 2, 8, 32, rank=rank, world_size=world)
    config = InMemoryCkptConfig(disk_folder=Path(folder) / f"rank-{rank}", run_id="faults")

    def enable(faults: Any, mtgs: MTGSConfig | None = MTGSConfig(max_retries=2)) -> Any:
        return enable_resiliency(
            ddp, opt, interval=2, state={"loader": loader}, config=config, mtgs=mtgs,
            faults=faults,
        )  # fmt: skip

    schedule = "nan_grad@1:2"
    everywhere = "nan_grad@0:3,nan_grad@1:3"  # a fault for each rank: both refuse
    out = {
        "unarmed": _refusal(lambda: enable(FaultInjector(everywhere, rank=rank))),
        "other_rank": _refusal(lambda: enable(FaultInjector(schedule, rank=1 - rank))),
        "type": _refusal(lambda: enable(schedule)),
    }
    armed = FaultInjector(schedule, rank=rank)
    armed.arm()
    out["no_mtgs"] = _refusal(lambda: enable(armed, mtgs=None))
    assert not armed.installed
    handle = enable(armed)
    assert armed.installed
    reasons = {}
    for step in range(1, 5):
        batch = next(loader)

        def closure(batch: Any = batch) -> torch.Tensor:
            inputs, targets = batch
            logits = ddp(inputs).view(-1, 32)
            return nn.functional.cross_entropy(logits, targets.reshape(-1))

        result = handle.train_step(closure)
        assert result.committed
        if result.retries:
            reasons[step] = sorted(n for names in result.reasons.values() for n in names)
    out["retried"] = reasons
    out["fired"] = [(f.fault.kind.value, f.step, f.attempt) for f in armed.fired]
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    out["steps"] = handle.step
    handle.close()
    out["installed_after_close"] = armed.installed
    return out


def test_an_armed_injector_given_as_faults_fires_and_is_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ARM_ENV, raising=False)
    results = run_distributed(_rank, 2, args=(str(tmp_path),), timeout_s=120)
    for rank, out in enumerate(results):
        assert "needs mtgs=MTGSConfig" in out["no_mtgs"], out
        assert f"faults='nan_grad@{rank}:3' is not armed" in out["unarmed"], out
        assert "built for rank=" in out["other_rank"], out
        assert "faults must be a lm_resiliency.faults.FaultInjector, got str" in out["type"]
        assert out["retried"] == {2: ["nonfinite_grad"]}, out  # aborted and retried everywhere
        assert out["fired"] == ([("nan_grad", 2, 0)] if rank == 1 else []), out
        assert out["finite"] and out["steps"] == 4
        assert out["installed_after_close"] is False

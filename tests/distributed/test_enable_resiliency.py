"""enable_resiliency on real Gloo ranks: resume after a crash, the durable fallback, DDP checks.

Every "generation" of a job is a separate ``run_distributed`` call (fresh
processes) sharing one node-local folder and run id, so a restarted generation
recovers as a torchrun-restarted one would: from node-local disk today, from
the slots' shared memory once they outlive the process. Assertions are on the
outcome (start step, bit-identical tensors), never on the source.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import ConfigError, InMemoryCkptConfig, enable_resiliency
from lm_resiliency.errors import RankFailures
from lm_resiliency.models import SyntheticTokens
from lm_resiliency.testing import run_distributed

_INTERVAL = 3
_CRASH_AFTER = 7  # the crashed generation trains 7 steps; step 6 is its newest capture
_STEPS = 11


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(32, 24),
        nn.Flatten(),
        nn.Linear(24 * 8, 48),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.LayerNorm(48),
        nn.Linear(48, 32 * 8),
    )


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs).view(-1, 32)
    return nn.functional.cross_entropy(logits, targets.reshape(-1))


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in tensors.items()}  # fmt: skip


def _final(ddp: DDP, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {f"p/{n}": p for n, p in ddp.module.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return _bits(out)


def _generation(rank: int, world: int, folder: str, run_id: str, stop: int) -> dict[str, Any]:
    """The plain loop with enable_resiliency; trains up to ``stop`` (a crash: no close)."""
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    loader = SyntheticTokens(1, 4, 8, 32, rank=rank, world_size=world)
    torch.manual_seed(10 + rank)
    config = InMemoryCkptConfig(disk_folder=folder, run_id=run_id, disk_flush_interval=_INTERVAL)
    resiliency = enable_resiliency(
        ddp, opt, interval=_INTERVAL, state={"loader": loader}, config=config
    )
    start = resiliency.start_step
    for step in range(resiliency.start_step + 1, stop + 1):
        _loss(ddp, next(loader)).backward()
        opt.step()
        opt.zero_grad()
    out = {
        "start": start,
        "step": resiliency.step,
        "source": resiliency.last_recovery.source,
        "captures": resiliency.stats.captures,
        "final": _final(ddp, opt),
    }
    if stop < _STEPS:
        resiliency.manager.wait_persisted()  # the crash comes after the flush of step 6
        dist.barrier()
    else:
        resiliency.close()
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("enable")
    crash_dir, ref_dir = str(tmp / "crash"), str(tmp / "ref")

    def generation(folder: str, run_id: str, stop: int) -> list[dict[str, Any]]:
        return run_distributed(_generation, 2, args=(folder, run_id, stop), timeout_s=120)

    return {
        "crashed": generation(crash_dir, "crash", _CRASH_AFTER),
        "resumed": generation(crash_dir, "crash", _STEPS),
        "reference": generation(ref_dir, "ref", _STEPS),
    }


def test_a_restarted_generation_resumes_after_the_newest_common_capture(
    resumed: dict[str, list[dict[str, Any]]],
) -> None:
    assert [r["start"] for r in resumed["crashed"]] == [0, 0]
    assert [r["source"] for r in resumed["crashed"]] == ["fresh", "fresh"]
    assert [r["captures"] for r in resumed["crashed"]] == [2, 2]  # steps 3 and 6
    assert [r["start"] for r in resumed["resumed"]] == [6, 6]
    assert [r["source"] for r in resumed["resumed"]] == ["gemini", "gemini"]
    assert [r["step"] for r in resumed["resumed"]] == [_STEPS, _STEPS]


def test_the_resumed_run_ends_bit_identical_to_the_uninterrupted_one(
    resumed: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        final, reference = resumed["resumed"][rank]["final"], resumed["reference"][rank]["final"]
        assert len(final) > 10  # parameters and AdamW state
        assert final == reference


def _fallback_run(rank: int, world: int, steps: list[int | None]) -> dict[str, Any]:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []

    def load_durable_checkpoint() -> int | None:
        calls.append(rank)
        with torch.no_grad():
            model.weight.fill_(float(rank + 1))
        return steps[rank]

    resiliency = enable_resiliency(
        DDP(model), opt, interval=5, load_fallback=load_durable_checkpoint,
        config=InMemoryCkptConfig(disk_folder="gemini", run_id="fallback"),
    )  # fmt: skip
    out = {
        "calls": calls,
        "start": resiliency.start_step,
        "step": resiliency.step,
        "source": resiliency.last_recovery.source,
        "sources": resiliency.last_recovery.sources,
        "weight": float(model.weight[0, 0]),
    }
    resiliency.close()
    return out


def test_load_fallback_runs_on_every_rank_and_its_step_becomes_the_start_step() -> None:
    out = run_distributed(_fallback_run, 2, args=([7, 7],), timeout_s=60)
    assert [r["calls"] for r in out] == [[0], [1]]
    assert [r["start"] for r in out] == [7, 7]
    assert [r["step"] for r in out] == [7, 7]
    assert [r["source"] for r in out] == ["fallback", "fallback"]
    assert [r["sources"] for r in out] == [("fallback", "fallback")] * 2
    assert [r["weight"] for r in out] == [1.0, 2.0]  # what each rank's fallback restored


def test_fallback_steps_that_differ_between_ranks_fail_on_every_rank() -> None:
    with pytest.raises(RankFailures) as info:
        run_distributed(_fallback_run, 2, args=([7, None],), timeout_s=60)
    assert info.value.ranks == [0, 1]
    for failure in info.value.failures.values():
        assert failure.exc_type == "ConfigError"
        assert "load_fallback() returned different steps on different ranks" in failure.message
        assert "{0: 7, 1: None}" in failure.message


def _static_graph(rank: int, world: int) -> str:
    ddp = DDP(nn.Linear(4, 4), static_graph=True)
    try:
        enable_resiliency(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_static_graph_ddp_is_rejected_before_any_collective() -> None:
    messages = run_distributed(_static_graph, 2, timeout_s=60)
    for message in messages:
        assert "DistributedDataParallel(static_graph=True) is not supported" in message
        assert "construct DDP with static_graph=False" in message


def _ddp_replay(rank: int, world: int) -> dict[str, Any]:
    """In-process restart: the DDP adapter alone (no manager) makes the resume bit-identical."""
    from lm_resiliency.integrations.ddp import DDPAdapter

    def build() -> tuple[DDP, torch.optim.Optimizer, DDPAdapter]:
        ddp = DDP(_model(), bucket_cap_mb=0.01)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        return ddp, opt, DDPAdapter(ddp, [opt])

    def train(ddp: DDP, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            torch.manual_seed(100 * step + rank)  # dropout; no RNG restore needed here
            _loss(ddp, next(SyntheticTokens(step, 4, 8, 32, rank=rank))).backward()
            opt.step()
            opt.zero_grad()

    ddp, opt, _ = build()
    train(ddp, opt, range(6))
    reference = _final(ddp, opt)
    out: dict[str, Any] = {}
    for replay in (True, False):
        ddp, opt, adapter = build()
        train(ddp, opt, range(3))
        saved = adapter.state_dict()
        out["order"] = saved["ddp"]["ready_order"]
        saved = {
            "model": {k: v.clone() for k, v in saved["model"].items()},
            "optimizers": [
                {"state": {i: {k: v.clone() for k, v in s.items()}
                           for i, s in o["state"].items()},
                 "param_groups": o["param_groups"]}
                for o in saved["optimizers"]
            ],
            "ddp": saved["ddp"] if replay else {"ready_order": []},
        }  # fmt: skip
        del ddp, opt, adapter
        ddp, opt, adapter = build()
        adapter.load_state_dict(saved)
        out[f"grads_none_{replay}"] = all(p.grad is None for p in ddp.parameters())
        train(ddp, opt, range(3, 6))
        out[f"identical_{replay}"] = _final(ddp, opt) == reference
    return out


def test_replaying_the_recorded_ready_order_is_what_makes_ddp_resume_bit_identical() -> None:
    out = run_distributed(_ddp_replay, 4, timeout_s=60)  # 2 ranks add exactly in any order
    for r in out:
        assert sorted(r["order"]) == list(range(7))  # every managed parameter once
        assert r["order"] != list(range(7))  # ready order is not registration order
        assert r["grads_none_True"] and r["grads_none_False"]
        assert r["identical_True"]
        assert not r["identical_False"]  # the fresh layout rounds differently

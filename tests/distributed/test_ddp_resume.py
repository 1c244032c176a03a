"""Resuming DDP from a bit-exact checkpoint is bit-identical only with primed buckets.

4 real Gloo ranks train a small MLP (parameters of several sizes, dropout, a
LayerNorm, a small ``bucket_cap_mb`` so DDP uses several buckets) with Adam.
A restart is emulated in-process: after K steps the model, optimizer and RNG
state are copied to CPU, DDP and the optimizer are destroyed and rebuilt from
that copy, and training continues to N steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.integrations.ddp import prime_ddp_buckets
from lm_resiliency.testing import run_distributed

_STEPS = 8
_RESUME_AT = 3
_BUCKET_CAP_MB = 0.004  # ~4 KB buckets: the rebuilt layout has 3 buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(64, 48),
        nn.LayerNorm(48),
        nn.Linear(48, 40),
        nn.Tanh(),
        nn.Linear(40, 16),
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _train(ddp: DDP, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _loss(ddp, step, rank).backward()
        opt.step()


def _build(state: dict[str, Any] | None, rank: int) -> tuple[DDP, torch.optim.Optimizer]:
    model = _model()
    if state is not None:
        model.load_state_dict(state["model"])
    ddp = DDP(model, bucket_cap_mb=_BUCKET_CAP_MB)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    if state is not None:
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
    else:
        torch.manual_seed(100 + rank)  # the dropout stream, different per rank
    return ddp, opt


def _params(ddp: DDP) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.module.parameters()]


def _bits(params: list[torch.Tensor]) -> list[bytes]:
    # Raw bytes travel back to the test process exactly (tensors would go through
    # shared-memory handles that die with the rank).
    return [p.numpy().tobytes() for p in params]


def _fault_free_and_resumed(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ddp, opt = _build(None, rank)
    initial_layout = ddp._get_ddp_logging_data()["bucket_sizes"]
    _train(ddp, opt, range(_STEPS), rank)
    reference = _params(ddp)
    out: dict[str, Any] = {"fault_free": _bits(reference)}
    out["initial_buckets"] = initial_layout
    out["rebuilt_buckets"] = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    for prime in (True, False):
        ddp, opt = _build(None, rank)
        _train(ddp, opt, range(_RESUME_AT), rank)
        saved = {
            "model": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict()),
            "rng": torch.get_rng_state(),
        }
        del ddp, opt  # the "crash": nothing of the old DDP or optimizer survives
        ddp, opt = _build(saved, rank)
        rng_before = torch.get_rng_state()
        params_before = _params(ddp)
        if prime:
            prime_ddp_buckets(ddp, lambda m: _loss(m, _RESUME_AT, rank))
            out["prime_kept_rng"] = torch.equal(torch.get_rng_state(), rng_before)
            out["prime_kept_params"] = all(
                torch.equal(a, b) for a, b in zip(params_before, _params(ddp), strict=True)
            )
            out["prime_kept_grads_none"] = all(p.grad is None for p in ddp.parameters())
        _train(ddp, opt, range(_RESUME_AT, _STEPS), rank)
        final = _params(ddp)
        out["primed" if prime else "unprimed"] = _bits(final)
        out["max_diff_primed" if prime else "max_diff_unprimed"] = max(
            (a - b).abs().max().item() for a, b in zip(final, reference, strict=True)
        )
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_fault_free_and_resumed, 4, timeout_s=240)


def test_ddp_rebuilds_into_several_buckets_after_the_first_step(
    runs: list[dict[str, Any]],
) -> None:
    # The premise: a fresh DDP's layout differs from the one it trains with later.
    for r in runs:
        assert len(r["rebuilt_buckets"].split(",")) >= 3
        assert r["initial_buckets"] != r["rebuilt_buckets"]


def test_primed_resume_is_bit_identical_to_fault_free_run(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert len(r["primed"]) == 10  # weight and bias of 4 Linear layers and the LayerNorm
        assert r["primed"] == r["fault_free"]
        assert r["max_diff_primed"] == 0.0


def test_priming_leaves_rng_params_and_grads_untouched(runs: list[dict[str, Any]]) -> None:
    assert [
        (r["prime_kept_rng"], r["prime_kept_params"], r["prime_kept_grads_none"]) for r in runs
    ] == [(True, True, True)] * 4


def test_unprimed_resume_drifts_in_the_last_bits(runs: list[dict[str, Any]]) -> None:
    # The failure the helper exists for: same state, other bucket layout, other sums.
    for r in runs:
        assert r["unprimed"] != r["fault_free"]
        assert 0.0 < r["max_diff_unprimed"] < 1e-3  # rounding drift, not another computation


def test_prime_rejects_a_module_that_is_not_ddp() -> None:
    with pytest.raises(TypeError, match="needs a DistributedDataParallel module, got Sequential"):
        prime_ddp_buckets(_model(), lambda m: m(torch.zeros(1, 32)).sum())  # type: ignore[arg-type]

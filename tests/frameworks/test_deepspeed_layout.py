"""DeepSpeed state captured under one ZeRO layout is refused by another, naming what changed.

Two real engines on 2 Gloo ranks (``run_distributed``), ZeRO-2 and ZeRO-1 over
the same model: restoring the ZeRO-2 capture into the ZeRO-1 engine raises
``ConfigError`` naming the stage, and nothing of the live engine changes. Also:
``enable_resiliency(engine, optimizer)`` is refused (the engine owns its
optimizer). Skipped where DeepSpeed is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
from fw_runs import EXTENSIONS_DIR, clear_stale_build_locks

from lm_resiliency.testing import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed; `make extras` (pip install -e .[deepspeed]) adds it",
)


def _engine(stage: int) -> object:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _refusals(rank: int, world_size: int) -> tuple[str, str, bool]:
    import deepspeed
    import torch

    from lm_resiliency.errors import ConfigError
    from lm_resiliency.integrations.deepspeed import make_adapter

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the launcher's group
    zero2, zero1 = make_adapter(_engine(2), []), make_adapter(_engine(1), [])
    before = [m.clone() for m in zero1.view.masters]
    with pytest.raises(ConfigError) as layout:
        zero1.load_state_dict(zero2.state_dict())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, zero1.view.masters, strict=True))
    with pytest.raises(ConfigError) as owner:
        make_adapter(zero1.engine, [torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)])
    return str(layout.value), str(owner.value), unchanged


def test_restore_under_another_zero_stage_names_the_change_and_touches_nothing() -> None:
    clear_stale_build_locks()
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR)}
    results = run_distributed(_refusals, 2, env=env, timeout_s=240)
    for layout, owner, unchanged in results:
        assert "stage: captured 2, now 1" in layout
        assert "restore with the same ZeRO stage" in layout
        assert "owns its optimizer" in owner
        assert unchanged

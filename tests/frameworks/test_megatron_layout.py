"""Megatron state captured under one parallel layout is refused by another, naming what changed.

Two real Gloo ranks (``run_distributed``) behind the test-only
``megatron_cpu_shim``: the ``megatron_build`` setup is trained one step under
TP=1/DP=2 and captured; then Megatron's model-parallel state is rebuilt under
TP=2/DP=1 (``destroy_model_parallel`` + ``initialize_model_parallel``) with a
new model, optimizer and scheduler, trained one step. Restoring the first
capture into the second raises ``ConfigError`` naming each size that changed
and the fix, and nothing of the live optimizer (main-param shards, Adam state,
LR), scheduler or model changes. Skipped where Megatron Core is not installed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from lm_resiliency.testing import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="Megatron Core is not installed; `make extras` (pip install -e .[megatron]) adds it",
)


def _live(adapter: Any) -> dict[str, Any]:
    """Everything a restore could write, cloned."""
    out: dict[str, Any] = {"lr": [g["lr"] for g in adapter.optimizer.param_groups]}
    for i, part in enumerate(adapter.parts):
        for j, master in enumerate(part.masters):
            out[f"master.{i}.{j}"] = master.detach().clone()
            for key, value in part.inner.state[master].items():
                out[f"optim.{i}.{j}.{key}"] = value.clone()
    for name, param in adapter.chunks[0].named_parameters():
        out[f"param.{name}"] = param.detach().clone()
    out["scheduler_steps"] = adapter.scheduler.num_steps
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _refusal(rank: int, world_size: int) -> tuple[str, bool, int]:
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    from megatron.core import parallel_state
    from megatron_build import build, train_step

    from lm_resiliency.errors import ConfigError
    from lm_resiliency.integrations.megatron import make_adapter

    dp2 = build(steps=4, tp=1)
    train_step(dp2, 1, rank)
    captured = make_adapter([dp2.chunk], [dp2.optimizer], scheduler=dp2.scheduler).state_dict()

    parallel_state.destroy_model_parallel()
    tp2 = build(steps=4, tp=2)
    train_step(tp2, 1, rank)
    adapter = make_adapter([tp2.chunk], [tp2.optimizer], scheduler=tp2.scheduler)
    before = _live(adapter)
    with pytest.raises(ConfigError) as refused:
        adapter.load_state_dict(captured)
    return str(refused.value), _same(before, _live(adapter)), len(before)


def test_restore_under_another_tensor_parallel_size_names_the_change_and_touches_nothing() -> None:
    results = run_distributed(_refusal, 2, timeout_s=120)
    for rank, (message, unchanged, compared) in enumerate(results):
        assert message.startswith("Megatron state was captured under another layout (")
        assert "dp_world_size: captured 2, now 1" in message
        assert "tp_world_size: captured 1, now 2" in message
        assert "master_numels: captured" in message  # each rank's shards were cut differently
        assert ("dp_rank: captured 1, now 0" in message) == (rank == 1)
        assert "pp_world_size" not in message  # only what changed is named
        assert "restore with the same tensor/pipeline/data-parallel sizes and model" in message
        assert unchanged
        assert compared > 10, compared

"""The TorchTitan adapter's refusals, on stand-ins for a built Trainer (no process group).

``check_supported`` reads only the Trainer's ``parallel_dims``, ``model_parts``,
``dataloader`` and ``config.checkpoint.load_step``; each unsupported setting
must raise ``ConfigError`` naming the setting and the fix. The registry must
route a TorchTitan ``Trainer`` to this adapter and refuse an optimizer passed
with it. Skipped where TorchTitan is not installed.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="TorchTitan is not installed; `make extras` (pip install -e .[torchtitan]) adds it",
)


def _loader(**kwargs: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(4)), **kwargs)
    loader.dp_rank, loader.dp_world_size = 0, 2  # what ParallelAwareDataloader adds
    return loader


def _trainer(**change: Any) -> SimpleNamespace:

    dims = {"pp_enabled": False, "pp": 1, "tp": 1, "cp": 1, "ep": 1}
    dims |= {"world_size": 2, "fsdp_enabled": True, "dp_replicate": 1, "dp_shard": 2}
    dims |= change.pop("dims", {})
    trainer = SimpleNamespace(
        parallel_dims=SimpleNamespace(**dims),
        model_parts=[torch.nn.Linear(2, 2)],
        dataloader=_loader(),
        config=SimpleNamespace(checkpoint=SimpleNamespace(load_step=-1)),
    )
    for key, value in change.items():
        setattr(trainer, key, value)
    return trainer


def _refusal(trainer: SimpleNamespace) -> str:
    from lm_resiliency.errors import ConfigError
    from lm_resiliency.integrations.torchtitan.adapter import check_supported

    with pytest.raises(ConfigError) as info:
        check_supported(trainer)
    return str(info.value)


def test_a_supported_configuration_passes() -> None:
    from lm_resiliency.integrations.torchtitan.adapter import check_supported

    check_supported(_trainer())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"dims": {"pp_enabled": True, "pp": 2}}, ["pipeline parallelism", "degree=1"]),
        ({"dims": {"tp": 2}}, ["'tp': 2", "degrees to 1"]),
        ({"dims": {"fsdp_enabled": False, "dp_shard": 1}}, ["without FSDP2", "shard_degree > 1"]),
        ({"dataloader": [1, 2]}, ["not a torchdata", "StatefulDataLoader"]),
        ({"config": SimpleNamespace(checkpoint=SimpleNamespace(load_step=4))}, ["load_step=4"]),
    ],
)
def test_unsupported_settings_are_refused_with_the_fix(
    change: dict[str, Any], words: list[str]
) -> None:
    message = _refusal(_trainer(**change))
    for word in words:
        assert word in message, message


def test_data_loader_workers_are_refused() -> None:
    assert "num_workers=1" in _refusal(_trainer(dataloader=_loader(num_workers=1)))


def test_a_loader_without_data_parallel_rank_is_refused() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(4)))
    assert "ParallelAwareDataloader" in _refusal(_trainer(dataloader=loader))


def test_registry_routes_a_torchtitan_trainer_and_refuses_an_optimizer() -> None:
    from lm_resiliency.errors import ConfigError
    from lm_resiliency.integrations.registry import adapter_for

    # The registry matches the class name and module in the MRO; importing the real
    # torchtitan.trainer needs triton (the worker's CPU shim), so a class with the
    # same identity stands in for it here.
    trainer_cls = type("Trainer", (), {"__module__": "torchtitan.trainer"})
    trainer = trainer_cls()
    with pytest.raises(ConfigError, match="owns its optimizers"):
        adapter_for(trainer, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))

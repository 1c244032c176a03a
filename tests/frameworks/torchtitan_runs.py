"""What the TorchTitan kill-and-recover tests share: the skip marker and a torchrun job runner.

``jobs(tmp, args)`` writes the local assets (``torchtitan_assets``) under ``tmp``
and returns ``job(name, *extra, nproc=2, restarts=0)``, which runs the worker
under torchrun offline (``HF_*_OFFLINE=1``) with ``args + extra``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from fw_runs import Job, run_job

PYTESTMARK = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="TorchTitan is not installed; `make extras` (pip install -e .[torchtitan]) adds it",
    ),
]

WORKER = Path(__file__).with_name("torchtitan_worker.py")
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def jobs(tmp: Path, args: list[str]) -> Callable[..., Job]:
    import torchtitan_assets

    assets = tmp / "assets"
    torchtitan_assets.make(assets)
    common = [*args, "--assets", str(assets)]

    def job(name: str, *extra: str, nproc: int = 2, restarts: int = 0) -> Job:
        return run_job(
            WORKER, tmp, name, [*common, *extra], nproc=nproc, max_restarts=restarts, env=_OFFLINE
        )

    return job

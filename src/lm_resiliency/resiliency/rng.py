"""Every random number generator a training step draws from, as a capturable state tree.

Captured at the step boundary and restored on recovery, so the resumed step
draws the same dropout masks, sampled batches and augmentations as the
uninterrupted run: torch's CPU generator, every CUDA device's generator (when
CUDA is initialised), Python's ``random`` and NumPy's global generator.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lm_resiliency.errors import ConfigError

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The generators' states now (a few kilobytes; no device synchronisation)."""
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = list(torch.cuda.get_rng_state_all())
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda,
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from :func:`capture_rng`).

    Raises ``ConfigError`` when the checkpoint holds CUDA generator states for
    more devices than this process sees.
    """
    # Own storage: torch.set_rng_state reads from the start of a tensor's storage,
    # ignoring a view's offset (restored tensors may be views into one arena).
    torch.set_rng_state(state["torch_cpu"].clone())
    cuda = list(state["torch_cuda"])
    if cuda:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) > visible:
            raise ConfigError(
                f"the checkpoint holds {len(cuda)} CUDA generator state(s) but this process "
                f"sees {visible} CUDA device(s); restore with the same visible devices"
            )
        torch.cuda.set_rng_state_all([t.clone() for t in cuda])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = dict(state["numpy"])
    np_state["state"] = dict(np_state["state"])
    np.random.set_state(np_state)

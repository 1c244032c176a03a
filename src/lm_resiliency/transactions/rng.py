"""Snapshot and restore every random number generator a training step may draw from.

Restoring the snapshot taken when a step began makes its retry draw the same
dropout masks and sampling decisions, so a retried step computes exactly what a
fault-free step would have computed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RngState:
    """Generator states of torch (CPU and every CUDA device), Python ``random`` and NumPy."""

    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]
    python: tuple[Any, ...]
    numpy: dict[str, Any]

    @classmethod
    def capture(cls) -> RngState:
        """Read the current states (no device synchronisation; a few kilobytes)."""
        cuda: tuple[torch.Tensor, ...] = ()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda = tuple(torch.cuda.get_rng_state_all())
        return cls(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
            python=random.getstate(),
            numpy=np.random.get_state(legacy=False),
        )

    def restore(self) -> None:
        """Put every generator back to this snapshot."""
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            torch.cuda.set_rng_state_all(list(self.torch_cuda))
        random.setstate(self.python)
        np.random.set_state(self.numpy)

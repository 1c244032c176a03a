"""Module buffers are captured as copies taken at the step boundary.

Parameters and optimizer state change only inside ``optimizer.step()``, whose
pre-hook waits for the capture in flight, so a capture may reference them and
copy them while the next forward and backward run. Buffers change *inside* the
forward, in place: BatchNorm's running statistics and batch counter, and
DDP's broadcast of rank 0's buffers into every rank's at the start of its
forward. Referenced like parameters, they would be copied after the next
forward had changed them (every capture of a BatchNorm model held the next
step's statistics). So they are copied at the boundary, on the training
thread: a host copy as large as the buffers (a BatchNorm layer: four small
tensors), or on a GPU a device copy on the current stream, ordered before the
next forward's kernels without waiting for them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["SavedBuffers", "restore_buffers", "save_buffers", "snapshot_buffers"]

SavedBuffers = list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]]
"""(owning module, buffer name, the buffer object, a copy of its value) per buffer."""


def snapshot_buffers(module: torch.nn.Module, state: MutableMapping[str, Any]) -> None:
    """Replace, in ``state`` (``module.state_dict()`` or a name -> buffer dict), every
    buffer of ``module`` by a copy taken now."""
    # nn.Module's method, not the instance's: a wrapper may shadow it with an attribute
    # (Megatron's DistributedDataParallel keeps its grad buffers in ``self.buffers``).
    for name, buf in torch.nn.Module.named_buffers(module):
        if buf is not None and name in state:
            state[name] = buf.detach().clone()


def save_buffers(module: torch.nn.Module) -> SavedBuffers:
    """Copies of every buffer of ``module`` and its submodules, to put back later."""
    with torch.no_grad():
        return [
            (owner, name, buf, None if buf is None else buf.detach().clone())
            for owner in module.modules()
            for name, buf in owner._buffers.items()
        ]


def restore_buffers(saved: SavedBuffers) -> None:
    """Put back what :func:`save_buffers` saved, in place; a buffer the module rebound
    to a new tensor since then (``self.buf = self.buf + 1``) gets its original object back."""
    with torch.no_grad():
        for owner, name, buf, value in saved:
            if owner._buffers.get(name) is not buf:
                owner._buffers[name] = buf
            if buf is not None and value is not None:
                buf.copy_(value)

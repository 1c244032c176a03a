"""Every random number generator a training step draws from: snapshot and restore.

Restoring a snapshot makes the next draws the same dropout masks, sampled
batches and augmentations as when it was taken: torch's CPU generator, every
CUDA device's generator (when CUDA is initialised), Python's ``random`` and
NumPy's global generator. Two users: MTGS restores the snapshot taken when a
step began before retrying it (:class:`RngState`, in process), and the front
door captures the generators at the step boundary and restores them on
recovery (:func:`capture_rng` / :func:`restore_rng`, as a state tree that goes
through the checkpoint).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lm_resiliency.errors import ConfigError

__all__ = ["RngState", "capture_rng", "restore_rng"]


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
        return cls(*_read())

    def restore(self) -> None:
        """Put every generator back to this snapshot.

        Raises ``ConfigError`` when the snapshot holds CUDA generator states for
        more devices than this process sees.
        """
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if len(self.torch_cuda) > visible:
                raise ConfigError(
                    f"the checkpoint holds {len(self.torch_cuda)} CUDA generator state(s) but "
                    f"this process sees {visible} CUDA device(s); restore with the same visible "
                    "devices"
                )
            torch.cuda.set_rng_state_all(list(self.torch_cuda))
        random.setstate(self.python)
        np.random.set_state(self.numpy)

    def as_tree(self) -> dict[str, Any]:
        """The snapshot as a capturable state tree (what :func:`capture_rng` returns)."""
        return {
            "torch_cpu": self.torch_cpu,
            "torch_cuda": list(self.torch_cuda),
            "python": self.python,
            "numpy": self.numpy,
        }

    @classmethod
    def from_tree(cls, state: dict[str, Any]) -> RngState:
        """The snapshot in ``state`` (from :meth:`as_tree`, possibly through a checkpoint)."""
        # Own storage: torch.set_rng_state reads from the start of a tensor's storage,
        # ignoring a view's offset (restored tensors may be views into one arena). A
        # decoded tree holds lists where the generators' states hold tuples.
        py = state["python"]
        np_state = dict(state["numpy"])
        np_state["state"] = dict(np_state["state"])
        return cls(
            torch_cpu=state["torch_cpu"].clone(),
            torch_cuda=tuple(t.clone() for t in state["torch_cuda"]),
            python=(py[0], tuple(py[1]), py[2]),
            numpy=np_state,
        )


def capture_rng() -> dict[str, Any]:
    """The generators' states now, as a state tree (a few kilobytes; no device synchronisation).

    What :meth:`RngState.as_tree` gives for :meth:`RngState.capture`, built directly: it
    runs at every capture boundary, on the training thread.
    """
    cpu, cuda, python, numpy = _read()
    return {"torch_cpu": cpu, "torch_cuda": list(cuda), "python": python, "numpy": numpy}


def _read() -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[Any, ...], dict[str, Any]]:
    """torch CPU, every CUDA device (when CUDA is initialised), Python ``random``, NumPy."""
    cuda: tuple[torch.Tensor, ...] = ()
    # is_initialized() alone: CUDA cannot be initialised where it is not available, and
    # is_available() asks the driver (microseconds at every capture boundary).
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = tuple(torch.cuda.get_rng_state_all())
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state(legacy=False)


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from :func:`capture_rng`).

    Raises ``ConfigError`` when the checkpoint holds CUDA generator states for
    more devices than this process sees.
    """
    RngState.from_tree(state).restore()

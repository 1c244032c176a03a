"""Which c10d backend a cross-replica group uses, and the NCCL environment it needs.

* :func:`resolve_backend`: ``"gloo"`` for CPU tensors, ``"nccl"`` for CUDA tensors, or the
  caller's explicit choice (validated against the device and this torch build).
* :func:`prepare_nccl_env`: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides what NCCL's watchdog
  does when a collective fails or times out. torch reads it in every ``ProcessGroupNCCL``
  constructor, so it is set before the first group of this process. Its values (torch 2.13,
  ``ErrorHandlingMode`` in ``ProcessGroupNCCL.hpp``): ``0`` no handling, ``1`` abort the
  communicators and kill the process, ``2`` abort the communicators and keep the process,
  ``3`` kill the process without aborting (torch's default when unset). ``1`` and ``3`` turn
  a peer's death into the survivor's death, which is the opposite of live membership, so
  they are refused; unset becomes ``2``. The legacy name ``NCCL_ASYNC_ERROR_HANDLING`` is
  checked too (torch still reads it).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "NCCL_ERROR_HANDLING_ENV",
    "NCCL_ERROR_HANDLING_LEGACY_ENV",
    "NCCL_KEEP_PROCESS",
    "prepare_nccl_env",
    "resolve_backend",
]

BACKENDS = ("gloo", "nccl")
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING_LEGACY_ENV = "NCCL_ASYNC_ERROR_HANDLING"
NCCL_KEEP_PROCESS = "2"
"""``CleanUpOnly``: the watchdog aborts a failed communicator and the process lives on."""

_ALLOWED = {"0": "no handling", "2": "abort the communicator, keep the process"}
_KILLING = {"1": "TearDown", "3": "SkipCleanUp"}


def resolve_backend(backend: str | None, device: torch.device | str | None) -> str:
    """The backend of a cross-replica group whose tensors live on ``device``.

    ``None`` picks ``"nccl"`` for a CUDA device and ``"gloo"`` otherwise. Raises
    ``ValueError`` for an unknown backend or NCCL with non-CUDA tensors, and
    ``RuntimeError`` when NCCL is asked for on a torch build without it.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if backend is None:
        return "nccl" if dev.type == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise ValueError(
            f"cross-replica backend {backend!r} is not one of {BACKENDS}; pass backend=None to "
            "pick it from the tensors' device (nccl for CUDA, gloo otherwise)"
        )
    if backend == "nccl":
        if dev.type != "cuda":
            raise ValueError(
                f"cross-replica backend 'nccl' needs CUDA tensors, but device is {dev}; pass "
                "device=torch.device('cuda', local_rank) or backend='gloo'"
            )
        if not dist.is_nccl_available():
            raise RuntimeError(
                f"cross-replica backend 'nccl' asked for, but this torch ({torch.__version__}) "
                "was built without NCCL; install a CUDA build of torch or use backend='gloo'"
            )
    return backend


def prepare_nccl_env(environ: MutableMapping[str, str] | None = None) -> str:
    """Make NCCL's watchdog keep this process alive when a peer dies; returns the value used.

    Sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` when neither it nor the legacy name is set.
    Raises ``ValueError`` when either is set to a value that kills the process on a peer's
    death (``1``, ``3``) or to something torch does not know.
    """
    env = os.environ if environ is None else environ
    for name in (NCCL_ERROR_HANDLING_ENV, NCCL_ERROR_HANDLING_LEGACY_ENV):
        value = env.get(name)
        if value is None:
            continue
        value = value.strip()
        if value in _KILLING:
            raise ValueError(
                f"{name}={value} ({_KILLING[value]}) makes NCCL's watchdog kill this process "
                "when a peer replica dies, so live membership cannot keep the survivors; set "
                f"{name}={NCCL_KEEP_PROCESS} (abort the communicator, keep the process) or "
                "unset it (the library then sets 2)"
            )
        if value not in _ALLOWED:
            raise ValueError(
                f"{name}={value!r} is not a value torch knows (0, 1, 2 or 3); set "
                f"{name}={NCCL_KEEP_PROCESS} or unset it"
            )
    current = env.get(NCCL_ERROR_HANDLING_ENV)
    if current is None:
        legacy = env.get(NCCL_ERROR_HANDLING_LEGACY_ENV)
        current = legacy.strip() if legacy is not None else NCCL_KEEP_PROCESS
        env[NCCL_ERROR_HANDLING_ENV] = current
    return current.strip()

"""Capture and in-place restore of a torch optimizer's state for an explicit list of params.

Framework optimizers (DeepSpeed ZeRO, Megatron's distributed optimizer) wrap a
plain ``torch.optim.Optimizer`` that steps this rank's fp32 master shards. Its
own ``state_dict()`` numbers parameters through ``param_groups``, which some
frameworks empty between steps (ZeRO-3), so the helpers here key the state by
the master tensors the caller names instead.

``capture`` only *references* the live state tensors (the manager copies them
asynchronously before the next step); ``restore`` copies into existing state
in place or creates it (a fresh process has none before its first step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_resiliency.errors import ConfigError

__all__ = [
    "capture_hparams",
    "capture_state",
    "check_layout",
    "restore_hparams",
    "restore_state",
]


def capture_state(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[dict[str, Any]]:
    """The optimizer state of each of ``params`` (``{}`` before its first step), by reference."""
    return [dict(optimizer.state.get(p, {})) for p in params]


def restore_state(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    states: Sequence[dict[str, Any]],
    *,
    what: str,
) -> None:
    """Put ``states`` back as the state of ``params``, in place where the state exists.

    Tensor values keep their captured dtype (Adam's ``step`` is a float32
    scalar) and move to the param's device. Raises ``ConfigError`` naming
    ``what`` when the count, the keys or a shape differ from the live state.
    """
    if len(states) != len(params):
        raise ConfigError(
            f"{what}: the checkpoint has optimizer state for {len(states)} master tensors "
            f"but this rank has {len(params)}; restore under the same parallel layout"
        )
    for i, (p, saved) in enumerate(zip(params, states, strict=True)):
        live = optimizer.state.get(p)
        if live and set(live) != set(saved):
            raise ConfigError(
                f"{what}: master {i} has optimizer state keys {sorted(live)} but the "
                f"checkpoint has {sorted(saved)}; restore with the same optimizer"
            )
        fresh: dict[str, Any] = {}
        for key, value in saved.items():
            if not isinstance(value, torch.Tensor):
                fresh[key] = value
                continue
            if value.dim() > 0 and value.shape != p.shape:
                raise ConfigError(
                    f"{what}: optimizer state {key!r} of master {i} has shape "
                    f"{tuple(value.shape)} but the master has {tuple(p.shape)}; restore "
                    "under the same parallel layout"
                )
            current = live.get(key) if live else None
            if isinstance(current, torch.Tensor) and current.shape == value.shape:
                current.copy_(value)
                fresh[key] = current
            else:
                fresh[key] = torch.empty_like(value, device=p.device).copy_(value)
        optimizer.state[p] = fresh


_NOT_HPARAMS = frozenset({"params"})
_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def capture_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (``lr``, ``betas``, ...), without its params.

    A scheduler writes the next step's ``lr`` into the group at its own step,
    so the group holds state the scheduler's ``state_dict`` alone cannot give back.
    Only plain values (numbers, strings, tensors and sequences of them) are
    state; objects a framework keeps in a group (a config) are construction-time
    constants and are left out.
    """
    return [
        {k: v for k, v in g.items() if k not in _NOT_HPARAMS and _plain(v)}
        for g in optimizer.param_groups
    ]


def restore_hparams(
    optimizer: torch.optim.Optimizer, hparams: Sequence[dict[str, Any]], *, what: str
) -> None:
    """Write captured hyperparameters back into the param groups; ``ConfigError`` on a mismatch."""
    groups = optimizer.param_groups
    if len(hparams) != len(groups):
        raise ConfigError(
            f"{what}: the checkpoint has {len(hparams)} optimizer param groups but the "
            f"optimizer has {len(groups)}; build the optimizer with the same groups"
        )
    for group, saved in zip(groups, hparams, strict=True):
        for key, value in saved.items():
            if key not in _NOT_HPARAMS:
                group[key] = value


def check_layout(saved: dict[str, Any], live: dict[str, Any], *, what: str, advice: str) -> None:
    """``ConfigError`` naming every key of ``live`` whose captured value differs.

    The optimizer shards a framework captures are only meaningful under the
    partitioning they were cut for; ``advice`` says how to restore instead.
    """
    changed = {k: (saved.get(k), v) for k, v in live.items() if saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: captured {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(f"{what} state was captured under another layout ({detail}); {advice}")

"""The caller's ``state`` objects: anything with ``state_dict()`` and ``load_state_dict()``.

A data loader (``torchdata``'s ``StatefulDataLoader``), a sampler, an LR
scheduler, a ``GradScaler``, an EMA model: each is captured with the step as
``obj.state_dict()`` and restored with ``obj.load_state_dict(...)``.

One kind needs more than that: an AMP ``GradScaler``. ``scaler.step(optimizer)``
calls ``optimizer.step()`` (where the capture happens) and the loop calls
``scaler.update()`` only after it returns, so the captured scaler state lacks
this step's update. Because the capture only happens for a step whose
``optimizer.step()`` ran, that update is the documented no-overflow one
(the growth tracker advances; at ``growth_interval`` the scale grows by
``growth_factor``), and it is applied on restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from lm_resiliency.errors import ConfigError
from lm_resiliency.state import encode_state

try:
    from torch.amp import GradScaler
except ImportError:  # pragma: no cover - torch < 2.3
    GradScaler = None  # type: ignore[assignment,misc]

__all__ = ["StateObjects", "is_grad_scaler", "is_lr_scheduler"]


class StateObjects:
    """The validated ``state`` mapping of ``enable_resiliency``; see the module doc."""

    def __init__(
        self, objects: Mapping[str, Any] | None, *, complete_scaler_update: bool = True
    ) -> None:
        self._complete_scaler_update = complete_scaler_update
        if objects is None:
            objects = {}
        if not isinstance(objects, Mapping):
            raise ConfigError(
                f"state must be a dict of name -> object with state_dict()/load_state_dict(), "
                f"got {type(objects).__name__}; e.g. state={{'loader': loader}}"
            )
        for name, obj in objects.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(
                    f"state key {name!r} is invalid; use a non-empty string without '/'"
                )
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(obj, method, None)):
                    raise ConfigError(
                        f"state[{name!r}] ({type(obj).__name__}) has no {method}(); pass "
                        "objects with state_dict() and load_state_dict() (a StatefulDataLoader, "
                        "an LR scheduler, a GradScaler, ...)"
                    )
        self._objects = dict(objects)

    def __len__(self) -> int:
        return len(self._objects)

    def items(self) -> list[tuple[str, Any]]:
        """The objects by name, in the order given."""
        return list(self._objects.items())

    def without(self, names: set[str]) -> StateObjects:
        """The same objects minus ``names`` (validated already)."""
        rest = StateObjects({}, complete_scaler_update=self._complete_scaler_update)
        rest._objects = {n: o for n, o in self._objects.items() if n not in names}
        return rest

    def state_dicts(self) -> dict[str, Any]:
        """Every object's ``state_dict()`` (captured as is; the codec copies nothing here)."""
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def schedulers_state_dicts(self) -> dict[str, Any]:
        """``state_dict()`` of the LR schedulers only (see :func:`is_step_scheduler`)."""
        return {n: o.state_dict() for n, o in self._objects.items() if is_step_scheduler(o)}

    def validate(self, wrap: Any) -> None:
        """Encode the current states as they will sit in the capture tree (``wrap(states)``).

        Raises ``StateEncodingError`` naming the key path of an unsupported value,
        at enable time instead of at the first capture (or worse, at recovery).
        """
        encode_state(wrap(self.state_dicts()))

    def load(self, states: Mapping[str, Any]) -> None:
        """Restore every object; raises ``ConfigError`` when the names do not match."""
        if set(states) != set(self._objects):
            raise ConfigError(
                f"the checkpoint holds state objects {sorted(states)} but enable_resiliency "
                f"was given {sorted(self._objects)}; pass the same state names as the run "
                "that wrote it"
            )
        for name, obj in self._objects.items():
            saved = states[name]
            if self._complete_scaler_update and is_grad_scaler(obj):
                saved = _after_successful_update(saved)
            obj.load_state_dict(saved)


def is_grad_scaler(obj: Any) -> bool:
    """Whether ``obj`` is an AMP ``GradScaler`` (``torch.amp`` or ``torch.cuda.amp``)."""
    if GradScaler is None:  # pragma: no cover - torch < 2.3
        return False
    return isinstance(obj, GradScaler)


def _after_successful_update(state: dict[str, Any]) -> dict[str, Any]:
    """``GradScaler.update()`` after a step without overflow, on its ``state_dict()``."""
    if not state:  # a disabled scaler
        return state
    out = dict(state)
    tracker = int(out["_growth_tracker"]) + 1
    if tracker == int(out["growth_interval"]):
        # The scaler's scale is a float32 tensor: the product is rounded to float32.
        grown = torch.tensor(float(out["scale"]) * float(out["growth_factor"]), dtype=torch.float32)
        out["scale"] = float(grown)
        tracker = 0
    out["_growth_tracker"] = tracker
    return out


def is_lr_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.optim.lr_scheduler.LRScheduler``."""
    return isinstance(obj, LRScheduler)


def is_step_scheduler(obj: Any) -> bool:
    """An LR scheduler the loop steps after ``optimizer.step()``.

    A torch ``LRScheduler`` or Megatron Core's ``OptimizerParamScheduler``
    (recognised by its class's name and module, without importing Megatron).
    """
    if is_lr_scheduler(obj):
        return True
    return any(
        c.__name__ == "OptimizerParamScheduler" and c.__module__.startswith("megatron.")
        for c in type(obj).__mro__
    )

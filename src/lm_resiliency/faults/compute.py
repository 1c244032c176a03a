"""Compute faults for SCOUT: persistent SDC, a one-shot parameter bit flip, a slow rank.

Each fault acts on one rank and starts at one optimizer step; the step is the
number of ``optimizer.step()`` calls completed, counted by a post-step hook the
injector installs. A fault "from step ``s``" is active as soon as step ``s``
completed: the check at boundary ``s`` and every later forward see it.

* :class:`PersistentSDC` - from ``from_step`` on, a forward hook the injector
  installs on ``module`` perturbs its output on **every** call: training
  forwards and SCOUT replays alike (a device that computes this module wrong);
* :class:`BitFlip` - once, right after optimizer step ``step``, one bit of one
  element of ``param`` flips in place (a memory upset in the weights);
* :class:`SlowRank` - from ``from_step`` on, every call of ``module`` first
  sleeps ``delay_s`` (a throttled or contended device).

Guarded like the MTGS injector: installing faults needs ``LM_RESILIENCY_FAULTS=1``
or :meth:`ComputeFaults.arm`.

Call order::

    faults = ComputeFaults([PersistentSDC(rank=1, module=model.blocks[0], from_step=25)],
                           rank=rank)
    faults.arm()
    faults.install(optimizer)
    ...
    faults.remove()
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults.injector import ARM_ENV


def _check(rank: int, step: int, what: str) -> None:
    for name, value in (("rank", rank), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{what}: {name}={value!r} must be an int >= 0")


@dataclass(frozen=True, eq=False)
class PersistentSDC:
    """``module``'s output on ``rank`` is perturbed on every call from ``from_step`` on."""

    rank: int
    module: nn.Module
    from_step: int
    scale: float = 1e-3
    """Added to every element of the first floating-point output tensor."""

    def __post_init__(self) -> None:
        _check(self.rank, self.from_step, "PersistentSDC")


@dataclass(frozen=True, eq=False)
class BitFlip:
    """Bit ``bit`` of element ``index`` of ``param`` on ``rank`` flips after step ``step``."""

    rank: int
    param: torch.Tensor
    step: int
    index: int = 0
    bit: int = 22

    def __post_init__(self) -> None:
        _check(self.rank, self.step, "BitFlip")
        if not 0 <= self.bit < self.param.element_size() * 8:
            raise ConfigError(f"BitFlip: bit={self.bit} is outside the element's bits")
        if not 0 <= self.index < self.param.numel():
            raise ConfigError(f"BitFlip: index={self.index} outside {self.param.numel()} elements")


@dataclass(frozen=True, eq=False)
class SlowRank:
    """Every call of ``module`` on ``rank`` sleeps ``delay_s`` first, from ``from_step`` on."""

    rank: int
    module: nn.Module
    from_step: int
    delay_s: float

    def __post_init__(self) -> None:
        _check(self.rank, self.from_step, "SlowRank")
        if self.delay_s <= 0:
            raise ConfigError(f"SlowRank: delay_s={self.delay_s} must be > 0")


ComputeFault = PersistentSDC | BitFlip | SlowRank


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``index`` of ``t`` in place (any dtype)."""
    with torch.no_grad():
        raw = t.detach().view(-1).view(torch.uint8)
        byte = index * t.element_size() + bit // 8
        raw[byte] ^= 1 << (bit % 8)


class ComputeFaults:
    """The compute faults of one rank; see the module docstring."""

    def __init__(self, faults: Sequence[ComputeFault], *, rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.step = 0
        """Optimizer steps completed (counted by the installed hook)."""
        self.fired: list[tuple[str, int]] = []
        """``(kind, step)`` of each first activation."""
        self._armed = False
        self._handles: list[Any] = []

    def arm(self) -> None:
        """Opt this process in to fault injection."""
        self._armed = True

    @property
    def armed(self) -> bool:
        return self._armed or os.environ.get(ARM_ENV) == "1"

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Attach the step counter to ``optimizer`` and each fault's hook to its module.

        Raises ``ConfigError`` when this rank has faults but the process is not armed.
        """
        if self.faults and not self.armed:
            raise ConfigError(
                f"refusing to inject {len(self.faults)} compute fault(s) into a process that did "
                f"not opt in: set {ARM_ENV}=1 or call ComputeFaults.arm()"
            )
        self._handles.append(optimizer.register_step_post_hook(self._after_step))
        for f in self.faults:
            if isinstance(f, PersistentSDC):
                self._handles.append(f.module.register_forward_hook(self._sdc_hook(f)))
            elif isinstance(f, SlowRank):
                self._handles.append(f.module.register_forward_pre_hook(self._slow_hook(f)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _note(self, kind: str) -> None:
        if all(k != kind for k, _ in self.fired):
            self.fired.append((kind, self.step))

    def _active(self, from_step: int) -> bool:
        return self.step >= from_step

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        for f in self.faults:
            if isinstance(f, BitFlip) and f.step == self.step:
                flip_bit(f.param, f.index, f.bit)
                self._note("bit_flip")

    def _sdc_hook(self, fault: PersistentSDC) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not self._active(fault.from_step):
                return None
            self._note("sdc")
            return _perturb(output, fault.scale)

        return hook

    def _slow_hook(self, fault: SlowRank) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._active(fault.from_step):
                self._note("slow")
                time.sleep(fault.delay_s)

        return hook


def _perturb(output: Any, scale: float) -> Any:
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output + scale
    if isinstance(output, (tuple, list)):
        items = list(output)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                items[i] = item + scale
                return type(output)(items) if isinstance(output, tuple) else items
    return output

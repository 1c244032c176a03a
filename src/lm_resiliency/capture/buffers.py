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

import threading
from collections.abc import MutableMapping
from typing import Any

import torch

from lm_resiliency.errors import ConfigError

__all__ = [
    "BoundaryBuffers",
    "SavedBuffers",
    "load_persistent_buffers",
    "match_persistent_buffers",
    "persistent_buffers",
    "restore_buffers",
    "save_buffers",
    "snapshot_buffers",
    "write_buffers",
]

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


def _persistent(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live buffers ``module.state_dict()`` would hold, by the same names."""
    live: dict[str, torch.Tensor] = {}
    for prefix, owner in module.named_modules():
        skip = owner._non_persistent_buffers_set
        for name, buf in owner._buffers.items():
            if buf is not None and name not in skip:
                live[f"{prefix}.{name}" if prefix else name] = buf
    return live


_structure = [0]
"""Bumped whenever any module anywhere registers or rebinds a buffer or a submodule."""
_hooks_lock = threading.Lock()
_hooks_installed = False


def _bump(*_args: Any) -> None:
    _structure[0] += 1


def _install_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if not _hooks_installed:
            # Process-wide and cheap (an increment): ``register_buffer``, a buffer or module
            # assignment (``self.x = ...``) and ``add_module`` all call these hooks.
            torch.nn.modules.module.register_module_buffer_registration_hook(_bump)
            torch.nn.modules.module.register_module_module_registration_hook(_bump)
            _hooks_installed = True


class BoundaryBuffers:
    """Copies of ``module``'s persistent buffers by ``state_dict()`` name, taken at the boundary.

    The list of (name, owning module, buffer name) is built once and rebuilt only
    after a buffer or submodule was registered or rebound anywhere in the process
    (module registration hooks bump a counter), so a boundary costs one copy per
    buffer and nothing per parameter or module. ``every_path``: one entry per
    path of a submodule reachable twice, as ``state_dict()`` has; otherwise each
    module once, as :func:`persistent_buffers` (and the restore's matcher) name them.
    ``named_buffers``: every buffer, persistent or not, each object once, by the
    names ``module.named_buffers()`` gives (FSDP2's per-rank buffers).
    """

    def __init__(
        self, module: torch.nn.Module, *, every_path: bool = False, named_buffers: bool = False
    ) -> None:
        _install_hooks()
        self._module = module
        self._every_path = every_path and not named_buffers
        self._named_buffers = named_buffers
        self._seen = -1
        self._entries: list[tuple[str, torch.nn.Module, str]] = []
        self.rebuilds = 0

    def _entries_now(self) -> list[tuple[str, torch.nn.Module, str]]:
        seen = _structure[0]
        if seen != self._seen:
            mods = torch.nn.Module.named_modules(
                self._module, remove_duplicate=not self._every_path
            )
            entries = []
            memo: set[int] = set()
            for prefix, owner in mods:
                for name, buf in owner._buffers.items():
                    if self._named_buffers:
                        if buf is None or id(buf) in memo:
                            continue
                        memo.add(id(buf))
                    elif name in owner._non_persistent_buffers_set:
                        continue
                    entries.append((f"{prefix}.{name}" if prefix else name, owner, name))
            self._entries = entries
            self._seen = seen
            self.rebuilds += 1
        return self._entries

    def copies(self) -> dict[str, torch.Tensor]:
        """Name -> a copy, taken now, of each persistent buffer (``None`` buffers left out)."""
        out: dict[str, torch.Tensor] = {}
        # No no_grad() block: a clone of a detached tensor records no autograd history, and
        # entering the mode costs more than the whole loop for a model without buffers.
        for key, owner, name in self._entries_now():
            buf = owner._buffers.get(name)
            if buf is not None:
                out[key] = buf.detach().clone()
        return out


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies, taken now, of the buffers ``module.state_dict()`` would hold, by the same names.

    For adapters whose state is not the module's ``state_dict()`` (DeepSpeed,
    Megatron: the optimizer's master partitions are the parameters' truth), so
    that BatchNorm statistics and other persistent buffers are captured too.
    Non-persistent buffers (rotary caches) are derived state and are left out.
    """
    with torch.no_grad():
        return {name: buf.detach().clone() for name, buf in _persistent(module).items()}


def match_persistent_buffers(
    module: torch.nn.Module, saved: dict[str, torch.Tensor] | None, *, what: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair ``module``'s persistent buffers with ``saved`` (from :func:`persistent_buffers`).

    Writes nothing. ``saved`` is ``None`` for a capture taken without buffers (an
    older version): accepted only when the module has no persistent buffers.
    Raises ``ConfigError`` when the names, shapes or dtypes differ from the
    module's. Returns ``(live buffer, saved value)`` pairs.
    """
    live = _persistent(module)
    if saved is None:
        if live:
            raise ConfigError(
                f"{what}: the checkpoint holds no module buffers but the model has "
                f"{sorted(live)[:4]} (captured by an lm-resiliency version that left them out); "
                "resume from the durable checkpoint instead"
            )
        return []
    if set(saved) != set(live):
        missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise ConfigError(
            f"{what}: the checkpoint's module buffers differ from the model's (missing "
            f"{missing[:4]}, unexpected {extra[:4]}); restore into the same model"
        )
    for name, buf in live.items():
        value = saved[name]
        if value.shape != buf.shape or value.dtype != buf.dtype:
            raise ConfigError(
                f"{what}: buffer {name} was captured as {tuple(value.shape)} {value.dtype} but "
                f"the model has {tuple(buf.shape)} {buf.dtype}; restore into the same model"
            )
    return [(buf, saved[name]) for name, buf in live.items()]


def write_buffers(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each saved value into its live buffer, in place (pairs from the matcher)."""
    with torch.no_grad():
        for buf, value in pairs:
            buf.copy_(value)


def load_persistent_buffers(
    module: torch.nn.Module, saved: dict[str, torch.Tensor] | None, *, what: str
) -> None:
    """:func:`match_persistent_buffers`, then write: nothing is written unless all match."""
    write_buffers(match_persistent_buffers(module, saved, what=what))

"""The shadow: a host copy of the state a committed step changes, for bit-identical rollback.

Call order (every step, on every rank)::

    shadow.begin()     # step start: launches the copy; returns at once
    ...forward, backward, vote...   # the copy overlaps them
    shadow.wait()      # before optimizer.step() modifies what is being copied
    optimizer.step(); scheduler.step()
    shadow.restore()   # only if the update failed (on this or any rank)

What is kept: every parameter once (tied weights share one copy), every
optimizer state entry (tensors such as ``exp_avg`` and ``step``, plain values
too, and which parameters had no state yet), the parameter groups'
hyper-parameters, the LR scheduler's and the AMP grad scaler's state, and the
buffers of ``module`` (BatchNorm statistics, counters: a failed attempt's
forward has already changed them in place, so a retry must start from the
values before it). Buffers are copied at ``begin`` on the caller's thread (the
forward that follows changes them; on a GPU a device copy on the current
stream); the other tensors are captured by GEMINI's
:class:`~lm_resiliency.capture.engine.CaptureEngine` (one slot): one flat
pre-faulted host arena (page-locked when CUDA is present), device tensors
copied on a side stream, host tensors by the engine's worker thread, so the
copy runs while the step computes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.capture.buffers import SavedBuffers, restore_buffers, save_buffers
from lm_resiliency.capture.engine import CaptureEngine
from lm_resiliency.errors import CaptureError

Key = tuple[str, int, str]  # ("param", i, "") | ("state", i, key) | ("group", g, key)


@dataclass
class _Plain:
    """The non-tensor part of the snapshot (small; copied on the caller's thread)."""

    state_keys: dict[int, tuple[str, ...]]
    state_values: dict[tuple[int, str], Any]
    groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None


class Shadow:
    """Host copy of parameters, optimizer, scheduler and scaler state; see the module doc.

    Not thread-safe: one training thread calls ``begin``/``wait``/``restore``.
    Errors of the background copy are raised as ``CaptureError`` by ``wait``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        module: torch.nn.Module | None = None,
        pin: bool = True,
    ) -> None:
        self._params = _unique(params)
        self._module = module
        self._buffers: SavedBuffers = []
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._scaler = scaler
        # No CRC-32C: the copy never leaves this process and is restored in place; the
        # checksum pass cost 1.5x the copy itself on the worker, every step.
        self._engine = CaptureEngine(pin_memory=pin, num_slots=1, checksums=False)
        self._keys: list[Key] = []
        self._devices: list[torch.device] = []
        self._plain: _Plain | None = None
        self.captures = 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor state in the arena (the bytes a restore copies)."""
        layout = self._engine.layout
        return 0 if layout is None else layout.total_bytes

    def begin(self) -> None:
        """Snapshot the current state; the tensor bytes are copied in the background."""
        self.wait()
        if self._module is not None:
            self._buffers = save_buffers(self._module)
        keys, tensors = self._collect()
        self._keys = keys
        self._devices = [t.device for t in tensors]
        self._plain = self._collect_plain()
        names = [f"{k[0]}.{k[1]}.{k[2]}" for k in keys]
        self._engine.capture_tensors(tensors, names, step=self.captures)
        self.captures += 1

    def wait(self) -> None:
        """Block until the copy launched by ``begin`` is complete; raises ``CaptureError``."""
        try:
            self._engine.wait_captured()
        except CaptureError as err:
            raise CaptureError(f"shadow copy failed: {err}") from err

    def restore(self, *, buffers: bool = True) -> None:
        """Write the snapshot back, bit for bit; state created since ``begin`` is removed.

        ``buffers=False`` keeps the module buffers (an update redone on the same
        gradients: the step's forward, which changed them, is not run again).
        """
        if self._plain is None:
            raise CaptureError("Shadow.restore() called before any Shadow.begin()")
        self.wait()
        plain = self._plain
        views = self._engine.current.views()
        index = {id(p): i for i, p in enumerate(self._group_params())}
        live: list[torch.Tensor] = []
        saved: list[torch.Tensor] = []
        opt = self._optimizer
        by_param = self._group_params()
        for (kind, i, name), view in zip(self._keys, views, strict=True):
            if kind == "param":
                live.append(self._params[i])
                saved.append(view)
            elif kind == "group":
                live.append(opt.param_groups[i][name])
                saved.append(view)
        # Optimizer state: drop what the failed step created, then refill.
        for p in list(opt.state.keys()):
            pos = index.get(id(p))
            if pos is None or pos not in plain.state_keys:
                del opt.state[p]
        for i, names in plain.state_keys.items():
            st = opt.state[by_param[i]]
            for extra in [k for k in st if k not in names]:
                del st[extra]
        for (kind, i, name), view, device in zip(self._keys, views, self._devices, strict=True):
            if kind != "state":
                continue
            st = opt.state[by_param[i]]
            cur = st.get(name)
            if (
                isinstance(cur, torch.Tensor)
                and cur.dtype == view.dtype
                and cur.shape == view.shape
            ):
                live.append(cur)
                saved.append(view)
            else:
                st[name] = view.to(device=device, copy=True)
        for (i, name), value in plain.state_values.items():
            opt.state[by_param[i]][name] = copy.deepcopy(value)
        with torch.no_grad():
            if live:
                torch._foreach_copy_(live, saved)
        if buffers:
            self.restore_buffers()
        for group, values in zip(opt.param_groups, plain.groups, strict=True):
            for k, v in values.items():
                group[k] = copy.deepcopy(v)
        if self._scheduler is not None and plain.scheduler is not None:
            self._scheduler.load_state_dict(copy.deepcopy(plain.scheduler))
        if self._scaler is not None and plain.scaler is not None:
            self._scaler.load_state_dict(plain.scaler)
            # A failure between scaler.step() and scaler.update() leaves a per-optimizer
            # stage behind ("already stepped"); the defaultdict rebuilds a fresh one.
            stages = getattr(self._scaler, "_per_optimizer_states", None)
            if stages is not None:
                stages.clear()

    def restore_buffers(self) -> None:
        """Put the module buffers back as they were at ``begin`` (every abort needs it: the
        failed attempt's forward changed them even when no update was applied)."""
        restore_buffers(self._buffers)

    def close(self) -> None:
        """Stop the copy worker and free the arena (the shadow can no longer be used)."""
        self._engine.close()

    # -- internals ---------------------------------------------------------------

    def _group_params(self) -> list[torch.Tensor]:
        return [p for g in self._optimizer.param_groups for p in g["params"]]

    def _collect(self) -> tuple[list[Key], list[torch.Tensor]]:
        keys: list[Key] = [("param", i, "") for i in range(len(self._params))]
        tensors: list[torch.Tensor] = [p.detach() for p in self._params]
        for i, p in enumerate(self._group_params()):
            st = self._optimizer.state.get(p)
            if not st:
                continue
            for name in sorted(st):
                v = st[name]
                if isinstance(v, torch.Tensor):
                    keys.append(("state", i, name))
                    tensors.append(v.detach())
        for g, group in enumerate(self._optimizer.param_groups):
            for name in sorted(group):
                if name != "params" and isinstance(group[name], torch.Tensor):
                    keys.append(("group", g, name))
                    tensors.append(group[name].detach())
        return keys, tensors

    def _collect_plain(self) -> _Plain:
        state_keys: dict[int, tuple[str, ...]] = {}
        values: dict[tuple[int, str], Any] = {}
        for i, p in enumerate(self._group_params()):
            st = self._optimizer.state.get(p)
            if not st:
                continue
            state_keys[i] = tuple(st)
            for name, v in st.items():
                if not isinstance(v, torch.Tensor):
                    values[(i, name)] = copy.deepcopy(v)
        groups = [
            {
                k: copy.deepcopy(v)
                for k, v in g.items()
                if k != "params" and not isinstance(v, torch.Tensor)
            }
            for g in self._optimizer.param_groups
        ]
        sched = None if self._scheduler is None else copy.deepcopy(self._scheduler.state_dict())
        scaler = None if self._scaler is None else dict(self._scaler.state_dict())
        return _Plain(state_keys, values, groups, sched, scaler)


def _unique(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters with tied (same-storage, same-view) tensors kept once."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for p in params:
        key = (
            p.device,
            p.untyped_storage().data_ptr(),
            p.storage_offset(),
            tuple(p.shape),
            tuple(p.stride()),
            p.dtype,
        )
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out

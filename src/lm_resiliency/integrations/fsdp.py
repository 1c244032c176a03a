"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and HSDP: each rank's own shards, no gathering.

What a rank captures: the local shard of every parameter (``DTensor.to_local()``,
a view of the sharded storage the optimizer updates) and of every sharded
optimizer state entry (AdamW's ``exp_avg``/``exp_avg_sq``), the replicated
optimizer entries (``step``) and the parameter groups; nothing is all-gathered.
Each parameter's mesh shape, placements, global and local shape are captured
with it, and restoring onto anything else fails with a ``ConfigError`` naming
the parameter and what changed (resharding is the durable checkpoint's job:
``torch.distributed.checkpoint`` through ``load_fallback``).

HSDP (a 2-D mesh, replicate x shard): the ranks along the replicate dimension
hold byte-identical shards, so ``parallel_layout()`` names them as natural
replicas (GEMINI keeps two own slots and skips the peer transfer when
``skip_replication_if_hsdp``) and gives their process group for the per-rank
state gather. Module buffers (BatchNorm statistics, computed from each rank's
own batches) are per-rank state under both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lm_resiliency.capture.buffers import BoundaryBuffers
from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations.base import AdapterBase, ParallelLayout
from lm_resiliency.state import Deferred

__all__ = ["FSDPAdapter", "make_adapter"]


class FSDPAdapter(AdapterBase):
    """A ``fully_shard``-ed model and its optimizers; ``framework`` is ``"fsdp2"`` or ``"hsdp"``.

    Construct on every rank after ``fully_shard`` and the optimizer. Raises
    ``ConfigError`` when the parameters are not DTensors on one device mesh.
    """

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().__init__(optimizers)
        self.model = model
        self._params = dict(model.named_parameters())
        meshes = {id(p.device_mesh): p.device_mesh for p in self._dtensors().values()}
        if len(meshes) != 1:
            raise ConfigError(
                f"the fully_shard-ed model's parameters live on {len(meshes)} device meshes; "
                "enable_resiliency supports one mesh (shard every module on the same mesh)"
            )
        self.mesh = next(iter(meshes.values()))
        self._replicate_dim = _replicate_dim(self._dtensors().values(), self.mesh)
        self.framework = "hsdp" if self._replicate_dim is not None else "fsdp2"
        self._fqn = {id(p): n for n, p in self._params.items()}
        self._buffers = BoundaryBuffers(model, named_buffers=True)

    def _dtensors(self) -> dict[str, DTensor]:
        out: dict[str, DTensor] = {}
        for n, p in self._params.items():
            if isinstance(p, DTensor):
                out[n] = p
        if not out:
            raise ConfigError(
                "the model has no DTensor parameters; call fully_shard(model) before "
                "enable_resiliency (or pass the unsharded model as a plain module)"
            )
        return out

    # -- capture -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with torch.no_grad():  # DTensor.to_local() without autograd's bookkeeping
            return {
                "layout": self._layout(),
                "params": self._local_params(),
                "optimizers": [self._optimizer_state(o, _hyper(o)) for o in self._optimizers],
            }

    def capture_state(self) -> dict[str, Any]:
        """:meth:`state_dict`, its per-parameter parts built by the capture worker (they read
        only shards and optimizer state, which change in ``optimizer.step()``); the param
        groups' hyperparameters are taken now (an LR scheduler steps right after)."""
        return {
            "layout": Deferred(self._layout),
            "params": Deferred(self._local_params),
            "optimizers": [
                Deferred(partial(self._optimizer_state, o, _hyper(o))) for o in self._optimizers
            ],
        }

    def rank_state_dict(self) -> dict[str, Any]:
        # Copies: the next forward changes them in place.
        return {"buffers": self._buffers.copies()}

    def _local_params(self) -> dict[str, Any]:
        return {n: _local(p) for n, p in self._params.items()}

    def _layout(self) -> dict[str, Any]:
        return {
            "world_size": dist.get_world_size(),
            "mesh_shape": list(self.mesh.shape),
            "mesh_dims": list(self.mesh.mesh_dim_names or ()),
            "params": {n: _describe(p) for n, p in self._params.items()},
        }

    def _optimizer_state(
        self, opt: torch.optim.Optimizer, hyper: list[dict[str, Any]]
    ) -> dict[str, Any]:
        if len(hyper) != len(opt.param_groups):
            raise ConfigError(
                f"the optimizer's param groups changed between the capture boundary and its "
                f"copy ({len(hyper)} -> {len(opt.param_groups)} groups); call add_param_group() "
                "before a step's optimizer.step(), not between it and the next one"
            )
        groups = []
        for values, group in zip(hyper, opt.param_groups, strict=True):
            groups.append({**values, "params": [self._fqn[id(p)] for p in group["params"]]})
        state: dict[str, Any] = {}
        for p, entries in opt.state.items():
            state[self._fqn[id(p)]] = {
                k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()
            }
        return {"param_groups": groups, "state": state}

    # -- restore -----------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_layout(state["layout"])
        saved_opts = state["optimizers"]
        if len(saved_opts) != len(self._optimizers):
            raise ConfigError(
                f"the checkpoint holds {len(saved_opts)} optimizer state(s) but "
                f"{len(self._optimizers)} optimizer(s) were given; pass the same optimizers"
            )
        with torch.no_grad():
            for name, saved in state["params"].items():
                _local(self._params[name]).copy_(saved)
        for opt, saved in zip(self._optimizers, saved_opts, strict=True):
            self._load_optimizer(opt, saved)

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        buffers = dict(self.model.named_buffers())
        saved = state.get("buffers", {})
        if set(saved) != set(buffers):
            raise ConfigError(
                f"the checkpoint's buffers {sorted(saved)} do not match the model's "
                f"{sorted(buffers)}; restore onto the same model"
            )
        with torch.no_grad():
            for name, value in saved.items():
                buffers[name].copy_(value)

    def _check_layout(self, saved: dict[str, Any]) -> None:
        now = self._layout()
        fix = (
            "GEMINI restores onto the same world, mesh and sharding only; to change them, "
            "resume from the framework's durable checkpoint (load_fallback)"
        )
        for key in ("world_size", "mesh_shape", "mesh_dims"):
            old = _plain(saved[key])
            if old != now[key]:
                raise ConfigError(
                    f"the checkpoint was captured with {key}={old} but this job has "
                    f"{key}={now[key]}; {fix}"
                )
        if set(saved["params"]) != set(now["params"]):
            missing = sorted(set(saved["params"]) ^ set(now["params"]))
            raise ConfigError(f"parameters {missing[:5]} differ from the checkpoint's; {fix}")
        for name, desc in now["params"].items():
            old = {k: _plain(v) for k, v in saved["params"][name].items()}
            if old != desc:
                changed = ", ".join(
                    f"{k} {old.get(k)} -> {desc[k]}" for k in sorted(desc) if old.get(k) != desc[k]
                )
                raise ConfigError(f"parameter {name!r}: {changed} since the checkpoint; {fix}")

    def _load_optimizer(self, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        order = [p for g in opt.param_groups for p in g["params"]]
        index = {self._fqn[id(p)]: i for i, p in enumerate(order)}
        groups = []
        for group in saved["param_groups"]:
            groups.append({**group, "params": [index[n] for n in group["params"]]})
        state: dict[int, dict[str, Any]] = {}
        for name, entries in saved["state"].items():
            param = self._params[name]
            state[index[name]] = {k: _rewrap(v, param) for k, v in entries.items()}
        opt.load_state_dict({"state": state, "param_groups": groups})

    def parallel_layout(self) -> ParallelLayout:
        if self._replicate_dim is None:
            return ParallelLayout()
        group = self.mesh.get_group(self._replicate_dim)
        ranks = tuple(dist.get_process_group_ranks(group))
        mesh = self.mesh.mesh
        dim = self._replicate_dim
        others = mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim])
        comparison = tuple(tuple(int(r) for r in row) for row in others)
        return ParallelLayout(
            replica_ranks=ranks, replica_group=group, comparison_groups=comparison
        )

    def modules(self) -> Sequence[torch.nn.Module]:
        return [self.model]


def _hyper(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's values but ``params``, as they are now."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t.detach()


def _describe(p: torch.Tensor) -> dict[str, Any]:
    if not isinstance(p, DTensor):
        return {"placements": "local", "shape": list(p.shape), "local_shape": list(p.shape)}
    return {
        "placements": ",".join(str(x) for x in p.placements),
        "shape": list(p.shape),
        "local_shape": list(p.to_local().shape),
    }


def _rewrap(value: Any, param: torch.Tensor) -> Any:
    """A captured optimizer entry as the live optimizer expects it (sharded like its param)."""
    if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
        return value
    local = param.to_local()
    if value.shape != local.shape or value.dim() == 0:
        return value  # a replicated entry such as Adam's step
    return DTensor.from_local(
        value.to(local.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _replicate_dim(params: Any, mesh: Any) -> int | None:
    """The mesh dimension every parameter is replicated along (HSDP), or ``None``."""
    if mesh.ndim < 2:
        return None
    dims = [
        d for d in range(mesh.ndim) if all(isinstance(p.placements[d], Replicate) for p in params)
    ]
    return dims[0] if dims else None


def make_adapter(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], **options: Any
) -> FSDPAdapter:
    """The registry's factory; ``options`` must be empty."""
    if options:
        raise ConfigError(f"the FSDP2 adapter takes no options, got {sorted(options)}")
    return FSDPAdapter(model, optimizers)

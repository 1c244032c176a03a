"""The capture tree of a step: what enable_resiliency captures, and how it is put back.

::

    {"format": "lm_resiliency.enable/1", "framework": "ddp", "step": 30,
     "adapter": adapter.state_dict(),                 # model, optimizer, DDP bucket order...
     "rank": {"rng": ..., "state": {...}, "adapter": adapter.rank_state_dict(),
              "replay": ["scheduler"]}}               # plain loop: the call still to come

Under HSDP (natural replicas, no peer transfer) ``"rank"`` is replaced by
``"ranks": {"<group rank>": per-rank part}`` holding the per-rank part of every
member of this rank's replica group (gathered at capture time), so a rank
restored from a replica's slot finds its own RNG and data position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lm_resiliency.control import all_gather_trees
from lm_resiliency.errors import ConfigError
from lm_resiliency.frontdoor.objects import StateObjects
from lm_resiliency.frontdoor.schedulers import SchedulerReplay
from lm_resiliency.integrations.base import Adapter, ParallelLayout
from lm_resiliency.rng import capture_rng, restore_rng
from lm_resiliency.state import Deferred

__all__ = ["FORMAT", "CaptureTree"]

FORMAT = "lm_resiliency.enable/1"


class CaptureTree:
    """Builds and applies capture trees for one rank (see the module doc)."""

    def __init__(
        self,
        adapter: Adapter,
        objects: StateObjects,
        layout: ParallelLayout,
        *,
        group_rank: int,
        restore_rng: Callable[[dict[str, Any]], None] = restore_rng,
        schedulers: SchedulerReplay | None = None,
    ) -> None:
        self._restore_rng = restore_rng
        self._schedulers = schedulers or SchedulerReplay(objects.items(), active=False)
        self._adapter = adapter
        self._objects = objects
        self._layout = layout
        self._rank = group_rank
        self._replicas = _replica_group_ranks(layout)

    def per_rank(self) -> dict[str, Any]:
        return {
            "rng": capture_rng(),
            "state": self._objects.state_dicts(),
            "adapter": self._adapter.rank_state_dict(),
        }

    def build(self, step: int, mine: dict[str, Any] | None = None) -> dict[str, Any]:
        """The tree for ``step``; under HSDP a small all-gather in the replica group.

        ``mine``: this rank's :meth:`per_rank` part when it was taken earlier (at the
        optimizer step of a framework that finishes its step later); taken now if None.
        The LR schedulers among the ``state`` objects are stepped by the loop after the
        optimizer, so their state is taken now in either case. In the plain loop (the
        capture runs inside ``optimizer.step()``) that is before their ``scheduler.step()``:
        the part names them under ``"replay"`` and the restore replays that call
        (``frontdoor/schedulers.py``).
        """
        tree: dict[str, Any] = {
            "format": FORMAT,
            "framework": self._adapter.framework,
            "step": step,
            # The adapter snapshots now what the next steps change before optimizer.step();
            # walking its (large, tensor-heavy) tree, and building the parts it defers, is
            # left to the capture worker (see state.Deferred and Adapter.capture_state).
            "adapter": Deferred(self._adapter.capture_state()),
        }
        if mine is None:
            mine = self.per_rank()
        else:
            late = self._objects.schedulers_state_dicts()
            if late:
                mine = {**mine, "state": {**mine["state"], **late}}
        replay = self._schedulers.to_replay()
        if replay:
            mine = {**mine, "replay": replay}
        if self._layout.replica_group is None:
            # The RNG states are fresh copies (tensors, tuples, arrays made by the read):
            # their walk can wait for the worker too. The ``state`` objects' values may be
            # their live internals, so they are walked here.
            tree["rank"] = {**mine, "rng": Deferred(mine["rng"])}
        else:
            parts = all_gather_trees(mine, self._layout.replica_group)
            tree["ranks"] = {str(r): p for r, p in zip(self._replicas, parts, strict=True)}
        return tree

    def validate(self) -> None:
        """Encode this rank's per-rank part now: unsupported ``state`` values fail at enable."""
        if self._layout.replica_group is None:
            self._objects.validate(lambda states: {"rank": {"state": states}})
        else:
            key = str(self._rank)
            self._objects.validate(lambda states: {"ranks": {key: {"state": states}}})

    def apply(self, tree: Any) -> int:
        """Restore everything in ``tree`` on this rank; returns its step. Collective (adapter)."""
        if not isinstance(tree, dict) or tree.get("format") != FORMAT:
            raise ConfigError(
                "the GEMINI checkpoint was not written by enable_resiliency (no "
                f"format={FORMAT!r}); resume it with the code that wrote it, or start a new run_id"
            )
        if tree["framework"] != self._adapter.framework:
            raise ConfigError(
                f"the checkpoint was captured from a {tree['framework']!r} model but "
                f"enable_resiliency was given a {self._adapter.framework!r} one; restore onto "
                "the same kind of model"
            )
        self._adapter.load_state_dict(tree["adapter"])
        if "rank" in tree:
            own = tree["rank"]
        else:
            ranks = tree["ranks"]
            if str(self._rank) not in ranks:
                raise ConfigError(
                    f"the checkpoint's per-rank state covers ranks {sorted(ranks)} but not "
                    f"rank {self._rank}; restore onto the same mesh"
                )
            own = ranks[str(self._rank)]
        self._objects.load(own["state"])
        self._schedulers.replay(own.get("replay", []))  # after the optimizer's param groups
        self._adapter.load_rank_state_dict(own["adapter"])
        self._restore_rng(own["rng"])  # last: nothing above may draw from the restored generators
        return int(tree["step"])


def _replica_group_ranks(layout: ParallelLayout) -> list[int]:
    """The replica group's members in its own rank order, numbered in the checkpoint group."""
    if layout.replica_group is None:
        return []
    members = dist.get_process_group_ranks(layout.replica_group)
    if layout.group is None or layout.group is dist.group.WORLD:
        return list(members)
    return [dist.get_group_rank(layout.group, g) for g in members]

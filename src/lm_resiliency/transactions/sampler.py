"""A distributed sampler that validates its shards and whose position is state.

``ShardedSampler`` gives rank ``r`` of ``world`` every ``world``-th index of the
epoch's order (a seeded permutation of ``range(n)``, or ``range(n)`` itself), and
drops the last ``n % world`` so that every rank has the same number of samples:
the shards are disjoint, and together they cover every index but those. Use it as
the ``sampler=`` of a ``DataLoader`` with ``num_workers=0`` and pass the sampler
as MTGS's ``data_state`` (or in ``enable_resiliency(state=...)``): its
``state_dict()`` is the epoch and the number of indices handed out, and
``load_state_dict()`` rewinds the iterator already running (a retried step gets
the same batch; a restored job resumes mid-epoch). With ``num_workers > 0`` the
loader draws indices ahead of the step, so the position would run ahead of the
training.

:meth:`validate` (collective, every rank of the group; run at construction when
a process group exists, and by :meth:`set_epoch`) all-gathers every rank's shard
and raises ``ConfigError`` on every rank alike, naming the ranks and the fix, when
the shards are not the same length, come from datasets of different lengths (also
when their shards are disjoint and of one length), or overlap (the typical causes:
a rank built with another ``rank``, ``num_replicas``, ``seed``, dataset length or
``shuffle``). It sends ``n`` int64 values per rank: for a dataset of
millions of samples, call it once per epoch, not per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lm_resiliency.errors import ConfigError

__all__ = ["ShardedSampler"]


class ShardedSampler(Sampler[int]):
    """This rank's shard of a dataset of ``len(dataset)`` samples (see the module doc).

    ``num_replicas``/``rank`` default to the process group's; ``group`` is the
    data-parallel group (default: the default group). Raises ``ConfigError`` for
    an empty shard, a rank outside ``0..num_replicas-1``, or (through
    :meth:`validate`) shards that do not partition the dataset.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        validate: bool = True,
    ) -> None:
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        self.group = group
        if num_replicas is None or rank is None:
            if not dist.is_initialized():
                raise ConfigError(
                    "ShardedSampler needs num_replicas= and rank= when no process group is "
                    "initialised; pass both, or call torch.distributed.init_process_group first"
                )
            num_replicas = dist.get_world_size(group) if num_replicas is None else num_replicas
            rank = dist.get_rank(group) if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            valid = f"0..{num_replicas - 1}" if num_replicas >= 1 else "none (num_replicas < 1)"
            raise ConfigError(
                f"ShardedSampler(rank={rank}, num_replicas={num_replicas}): rank must be in "
                f"{valid}; use the data-parallel rank and world size"
            )
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.num_samples = self.n // num_replicas
        if self.num_samples == 0:
            raise ConfigError(
                f"ShardedSampler: a dataset of {self.n} samples leaves no sample for each of "
                f"{num_replicas} ranks; use at least {num_replicas} samples"
            )
        self.epoch = 0
        self.position = 0
        """Indices of this epoch already handed out (what :meth:`state_dict` captures)."""
        self._indices = self._shard(0)
        if validate and dist.is_initialized():
            self.validate()

    def _shard(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        used = order[: self.num_samples * self.num_replicas]
        return used[self.rank :: self.num_replicas]

    def shard(self) -> list[int]:
        """This rank's indices for the current epoch, in order."""
        return list(self._indices)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        # Reads the position from the sampler at every draw, so load_state_dict()
        # rewinds an iterator the DataLoader already holds. A finished epoch stays
        # finished in the state (a restore does not replay it); iterating it again
        # without set_epoch() starts it over, as torch's DistributedSampler does.
        if self.position >= self.num_samples:
            self.position = 0
        while self.position < self.num_samples:
            index = self._indices[self.position]
            self.position += 1
            yield index

    def set_epoch(self, epoch: int, *, validate: bool = True) -> None:
        """Start ``epoch`` (every rank, before iterating it); validates the new shards."""
        self.epoch = epoch
        self.position = 0
        self._indices = self._shard(epoch)
        if validate and dist.is_initialized():
            self.validate()

    def state_dict(self) -> dict[str, Any]:
        """The epoch and position, plus what they mean (checked by :meth:`load_state_dict`)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "n": self.n,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s epoch and position; ``ConfigError`` if it is another split."""
        for key in ("n", "num_replicas", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"ShardedSampler state has {key}={state.get(key)!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; restore it into a sampler built the same way"
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise ConfigError(
                f"ShardedSampler state position={position} is outside 0..{self.num_samples}"
            )
        if int(state["epoch"]) != self.epoch:
            self.epoch = int(state["epoch"])
            self._indices = self._shard(self.epoch)
        self.position = position

    def validate(self) -> None:
        """Check that the ranks' shards partition the dataset (collective, every rank).

        Checks one ``num_replicas``, one shard length, one dataset length and
        disjoint shards: together these make the shards cover the dataset (every
        index of ``range(n)`` but the ``n % world`` dropped ones). Raises
        ``ConfigError`` on every rank (each computes the same verdict from the same
        gathered shards) naming the offending ranks and the fix.
        """
        world = dist.get_world_size(self.group)
        # One header per rank first: every rank decides from the same numbers, and
        # issues the same collectives, whatever it got wrong.
        header = _gather_ints(
            [self.n, self.rank, self.num_replicas, len(self._indices)], self.group
        )
        replicas = {r: h[2] for r, h in enumerate(header)}
        if any(v != world for v in replicas.values()):
            raise ConfigError(
                f"ShardedSampler: num_replicas per rank {replicas} but the process group has "
                f"{world} ranks; use num_replicas={world} (or leave it to the group)"
            )
        lengths = {r: h[3] for r, h in enumerate(header)}
        datasets = {r: h[0] for r, h in enumerate(header)}
        if len(set(lengths.values())) > 1:
            raise ConfigError(
                f"ShardedSampler: shard lengths differ across ranks {lengths} (dataset lengths "
                f"{datasets}); every rank must see the same dataset, so that every rank runs "
                "the same number of steps"
            )
        if len(set(datasets.values())) > 1:
            # equal shard lengths do not make one dataset (10 and 11 samples on 2 ranks both
            # give shards of 5): disjoint shards of different splits cover no single dataset
            raise ConfigError(
                f"ShardedSampler: dataset lengths differ across ranks {datasets}; every rank "
                "must see the same dataset (the same len(dataset)), so that the shards partition it"
            )
        shards = _gather_ints(self._indices, self.group)
        owner: dict[int, int] = {}
        for r, shard in enumerate(shards):
            for i in shard:
                if i in owner:
                    raise ConfigError(
                        f"ShardedSampler: index {i} is in the shards of ranks {owner[i]} and {r} "
                        f"(ranks passed: { {q: h[1] for q, h in enumerate(header)} }); shards "
                        "must be disjoint: give each rank its own rank= and the same seed= and "
                        "shuffle="
                    )
                owner[i] = r


def _gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """All-gather one list of ints per rank (lists of one length: the caller checked)."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(values)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    most = max(int(s) for s in sizes)
    mine = torch.full((most,), -1, dtype=torch.int64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty(most, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t[: int(s)].tolist() for t, s in zip(out, sizes, strict=True)]

"""Data exactly once under a changing membership (docs/live-membership.md §5).

The global batch is fixed: step ``s`` uses the ``B`` samples :func:`global_indices` gives for
``(seed, s)``, whoever computes it. The current members split those samples (:func:`split`,
strided, so shares differ by at most one), and each member scales its gradient by
:func:`weight`, so the sum over members is the mean over the whole global batch for any member
count. A step redone under a new membership re-splits the same ``B`` samples, so no sample is
lost or used twice.

* :class:`GlobalBatchSampler` is a ``batch_sampler`` for a plain
  ``DataLoader(dataset, batch_sampler=sampler)``: each time the loader asks for a batch it yields
  this member's share of the *current* step, read from a :class:`ShareSource` (the front door
  provides one; anything with a ``current() -> Share`` method works).
* A user's own loader takes part through :class:`IndexedLoader` (``indices_for(step, index,
  count)``) or :class:`ReshardableLoader` (``state_dict``/``load_state_dict`` plus
  ``reshard(index, count)``, called on every membership change); :func:`check_loader` rejects
  anything else.
* :func:`step_seed` / :func:`reseed_step` pin the random streams of a step to ``(seed, s, i, M)``
  so that dropout does not depend on which process used to hold which samples.

**How a DataLoader consumes a batch sampler** (torch 2.13, ``torch/utils/data/dataloader.py``):
``iter(loader)`` calls ``iter(batch_sampler)`` once. With ``num_workers=0`` the loader then calls
``next()`` on it exactly when the training loop asks for the next batch, so the share is read at
the moment the step's data is needed. With ``num_workers > 0`` the loader draws
``prefetch_factor * num_workers`` batches of indices as soon as it starts and one more after each
batch it hands out, i.e. before the steps they are for have begun and before a membership change
can be seen. Those indices cannot be kept exact, so the rule is: **``num_workers=0``** (the
sampler raises at the first early draw, :func:`check_loader` at enable time). A dataset whose
``__getitem__`` is slow can still use threads or workers *inside* the dataset.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from lm_resiliency.errors import ConfigError
from lm_resiliency.telemetry import EventLog

__all__ = [
    "LOSS_REDUCTIONS",
    "GlobalBatchSampler",
    "IndexedLoader",
    "ReshardableLoader",
    "SampledBatch",
    "Share",
    "ShareSource",
    "check_loader",
    "global_indices",
    "reseed_step",
    "split",
    "step_seed",
    "weight",
]

LOSS_REDUCTIONS = ("mean", "sum")
"""How the user's loss reduces over a member's local samples (``LiveConfig.loss_reduction``)."""

_STATE_VERSION = 1


def _stable_hash(*parts: int | str) -> int:
    """A 63-bit hash of ``parts`` that is the same in every process and Python version."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, data_epoch: int, dataset_len: int) -> torch.Tensor:
    # Cached: consecutive steps read the same epoch's permutation; a step straddling two
    # epochs reads both.
    gen = torch.Generator().manual_seed(_stable_hash("lmr-sampler", seed, data_epoch))
    return torch.randperm(dataset_len, generator=gen)


def _check_sizes(dataset_len: int, global_batch: int) -> None:
    if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
        raise ConfigError(f"dataset_len={dataset_len!r} must be an int >= 1 (len(dataset))")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(
            f"global_batch={global_batch!r} must be an int >= 1 (the samples of one step, "
            "summed over all replicas)"
        )


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"step={step!r} must be an int >= 1 (steps count from 1)")


def data_epoch_of(step: int, dataset_len: int, global_batch: int) -> int:
    """The data epoch (pass over the dataset) in which step ``step``'s first sample lies."""
    _check_step(step)
    _check_sizes(dataset_len, global_batch)
    return ((step - 1) * global_batch) // dataset_len


def global_indices(seed: int, step: int, dataset_len: int, global_batch: int) -> list[int]:
    """The ``global_batch`` sample ids of step ``step`` (1-based), over every member.

    A pure function of its arguments. The steps walk, ``global_batch`` at a time, through one
    permutation of ``range(dataset_len)`` per data epoch, each drawn from a ``torch.Generator``
    seeded by a stable hash of ``(seed, epoch)``. A step that straddles the end of an epoch takes
    the tail of that epoch's permutation and the head of the next one, so every epoch uses every
    sample exactly once. Raises ``ConfigError`` for a step < 1 or a size < 1.
    """
    _check_step(step)
    _check_sizes(dataset_len, global_batch)
    start = (step - 1) * global_batch
    out: list[int] = []
    while len(out) < global_batch:
        epoch, offset = divmod(start + len(out), dataset_len)
        take = min(global_batch - len(out), dataset_len - offset)
        out += _permutation(seed, epoch, dataset_len)[offset : offset + take].tolist()
    return out


def _check_share(index: int, count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"member count={count!r} must be an int >= 1")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(f"member index={index!r} must be an int in [0, {count})")


def split(indices: Sequence[int], index: int, count: int) -> list[int]:
    """Member ``index`` of ``count``'s share of ``indices``: ``indices[index::count]``.

    Strided, so the shares' sizes differ by at most one and depend only on ``(len(indices),
    count)``. Raises ``ConfigError`` when a member would get no sample (more members than
    samples: its mean loss would be undefined).
    """
    _check_share(index, count)
    if count > len(indices):
        raise ConfigError(
            f"{count} members cannot split a global batch of {len(indices)} samples (a member "
            f"would get none); use a global_batch of at least {count}"
        )
    return list(indices[index::count])


def share_size(global_batch: int, index: int, count: int) -> int:
    """``len(split(range(global_batch), index, count))`` without building the list."""
    _check_share(index, count)
    return (global_batch - index + count - 1) // count


def weight(n_local: int, global_batch: int, loss_reduction: str = "mean") -> float:
    """The factor a member scales its gradient by before the cross-replica SUM.

    ``"mean"`` (the user's loss is the mean over the member's ``n_local`` samples):
    ``n_local / global_batch``, so ``sum_i w_i * grad(mean_i)`` is the gradient of the mean over
    the global batch, and the weights of all members sum to 1. ``"sum"`` (the loss is a sum over
    the local samples): ``1 / global_batch``. Raises ``ConfigError`` for an unknown reduction or
    ``n_local`` outside ``[0, global_batch]``.
    """
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ConfigError(
            f"loss_reduction={loss_reduction!r} is not one of {', '.join(LOSS_REDUCTIONS)}; use "
            "'mean' when the loss averages over the local batch, 'sum' when it adds up"
        )
    _check_sizes(1, global_batch)
    if (
        isinstance(n_local, bool)
        or not isinstance(n_local, int)
        or not 0 <= n_local <= global_batch
    ):
        raise ConfigError(f"n_local={n_local!r} must be an int in [0, global_batch={global_batch}]")
    return (n_local if loss_reduction == "mean" else 1) / global_batch


def step_seed(seed: int, step: int, index: int, count: int) -> int:
    """The seed of member ``index`` of ``count`` at step ``step`` (63 bits, stable everywhere).

    A step computed by the same members draws the same random numbers whether it is a first
    attempt, a redo after a membership change, or a scripted run.
    """
    _check_step(step)
    _check_share(index, count)
    return _stable_hash("lmr-step", seed, step, index, count)


def reseed_step(
    seed: int, step: int, index: int, count: int, *, python_and_numpy: bool = False
) -> int:
    """Seed torch's CPU generator (and every CUDA device's, when CUDA is available) for a step.

    Called at every step begin in live mode, on every rank. Python's ``random`` and NumPy's
    global generator are seeded too only with ``python_and_numpy=True``
    (``LiveConfig.reseed_all``): many programs use them for things that must not change per step.
    Returns the seed used.
    """
    value = step_seed(seed, step, index, count)
    torch.manual_seed(value)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(value)
    if python_and_numpy:
        random.seed(value)
        np.random.seed(value % 2**32)
    return value


@dataclass(frozen=True)
class Share:
    """Which step the next batch is for, and this member's place in the membership computing it."""

    step: int
    """The step (1-based) whose data the loader is asked for now."""
    index: int
    """This member's index in the current membership (``members.index(replica)``)."""
    count: int
    """The number of members (``len(members)``)."""
    epoch: int = 0
    """The membership epoch the share belongs to (recorded; a new epoch may redo a step)."""
    member: int | None = None
    """This member's replica id (recorded only)."""


class ShareSource(Protocol):
    """Where :class:`GlobalBatchSampler` reads the current step and membership from.

    ``current()`` is called once per batch, on the training thread, just before the batch's
    indices are produced; its fields must be consistent with each other (one read).
    """

    def current(self) -> Share: ...


@runtime_checkable
class IndexedLoader(Protocol):
    """A user's loader that can produce any step's share on request."""

    def indices_for(self, step: int, index: int, count: int) -> Sequence[int]: ...


@runtime_checkable
class ReshardableLoader(Protocol):
    """A user's stateful loader that the front door re-splits on every membership change."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def reshard(self, index: int, count: int) -> None: ...


@dataclass(frozen=True)
class SampledBatch:
    """One batch handed out: the step, the membership epoch, the member and the sample ids."""

    step: int
    epoch: int
    member: int | None
    index: int
    count: int
    indices: tuple[int, ...]


class GlobalBatchSampler(Sampler[list[int]]):
    """A ``batch_sampler`` that yields this member's share of the current step's global batch.

    ``DataLoader(dataset, batch_sampler=GlobalBatchSampler(len(dataset), B, seed, source))``
    with ``num_workers=0``. Each time the loader asks for a batch, the sampler reads
    ``source.current()`` and yields ``split(global_indices(seed, step, len, B), index, count)``.
    Iteration ends after step ``steps`` when it is given (then ``len(sampler)`` is the number of
    steps left), else it is endless.

    Its position (the newest step it handed out) is state: :meth:`state_dict` /
    :meth:`load_state_dict`. It enforces that data is drawn exactly once per step: the next
    draw must be for the step after the newest one (a normal step) or for the same step under a
    new membership epoch (a redo). A second draw for the same step and epoch means the loader
    prefetches (``num_workers > 0``), and a draw that skips a step would lose its samples; both
    raise ``ConfigError`` naming the fix. ``events`` (an :class:`EventLog`, event
    ``live.sample``) and ``on_batch`` record every batch handed out.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        seed: int,
        membership_source: ShareSource,
        *,
        steps: int | None = None,
        events: EventLog | None = None,
        on_batch: Callable[[SampledBatch], None] | None = None,
    ) -> None:
        _check_sizes(dataset_len, global_batch)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed={seed!r} must be an int")
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
        ):
            raise ConfigError(f"steps={steps!r} must be None (endless) or an int >= 0")
        if not callable(getattr(membership_source, "current", None)):
            raise ConfigError(
                f"membership_source {type(membership_source).__name__} has no current() method; "
                "pass the front door's membership (handle.sampler(B) does) or an object whose "
                "current() returns a Share"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.steps = steps
        self._source = membership_source
        self._events = events
        self._on_batch = on_batch
        self._last: tuple[int, int] | None = None  # (step, epoch) of the newest draw
        self._served = 0  # the newest step handed out (0: none yet)

    # -- the pure parts, for the front door and for loaders of its own -------------------------

    def indices_for(self, step: int, index: int, count: int) -> list[int]:
        """Member ``index`` of ``count``'s sample ids of step ``step`` (no state changes)."""
        return split(
            global_indices(self.seed, step, self.dataset_len, self.global_batch), index, count
        )

    @property
    def served(self) -> int:
        """The newest step whose batch this sampler handed out (0 before the first)."""
        return self._served

    # -- the batch sampler ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator: an exception in a generator ends it, so after one failed draw
        # every retry of the step (MTGS redoes an aborted step with the same loader) would
        # get a bare StopIteration instead of the error or the batch.
        return _Draws(self)

    def _next(self) -> list[int]:
        share = self._source.current()
        if self.steps is not None and share.step > self.steps:
            raise StopIteration
        return self._draw(share)

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError(
                "GlobalBatchSampler without steps= is endless and has no len(); pass steps= "
                "(the total number of training steps) to give it one"
            )
        return max(0, self.steps - self._served)

    def _draw(self, share: Share) -> list[int]:
        if not isinstance(share, Share):
            raise ConfigError(
                f"membership_source.current() returned {type(share).__name__}, not a Share"
            )
        _check_step(share.step)
        redo = (
            self._last is not None and share.step == self._last[0] and share.epoch != self._last[1]
        )
        if share.step != self._served + 1 and not redo:
            if self._last is not None and self._last == (share.step, share.epoch):
                raise ConfigError(
                    f"the loader asked twice for the batch of step {share.step} (membership "
                    f"epoch {share.epoch}) before the step finished: it draws batches ahead, "
                    "which a changing membership cannot keep exactly once. Use "
                    "DataLoader(..., num_workers=0) with this batch_sampler (parallelise inside "
                    "the dataset instead)"
                )
            raise ConfigError(
                f"the loader asked for the batch of step {share.step} but the next step is "
                f"{self._served + 1} (the newest batch handed out was step {self._served}): "
                "steps in between would lose their samples, or a step would be drawn twice. "
                "After restoring a checkpoint, call load_state_dict() with the sampler state "
                "saved with it"
            )
        indices = self.indices_for(share.step, share.index, share.count)
        self._last = (share.step, share.epoch)
        self._served = share.step
        record = SampledBatch(
            share.step, share.epoch, share.member, share.index, share.count, tuple(indices)
        )
        if self._events is not None:
            self._events.log(
                "live.sample",
                step=record.step,
                epoch=record.epoch,
                member=record.member,
                index=record.index,
                count=record.count,
                indices=indices,
            )
        if self._on_batch is not None:
            self._on_batch(record)
        return indices

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position (newest step handed out) and the identity of the sample stream."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
            "served": self._served,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after step ``state["served"]``: the next draw must be for the step after it.

        Raises ``ConfigError`` when the state is of another sample stream (seed, dataset length
        or global batch differ) or malformed.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"not a GlobalBatchSampler state (version {_STATE_VERSION}): {state!r:.200}"
            )
        for name in ("seed", "dataset_len", "global_batch"):
            if state.get(name) != getattr(self, name):
                raise ConfigError(
                    f"sampler state has {name}={state.get(name)!r} but this sampler has "
                    f"{name}={getattr(self, name)!r}; build the sampler as the saved run did"
                )
        served = state.get("served")
        if isinstance(served, bool) or not isinstance(served, int) or served < 0:
            raise ConfigError(f"sampler state has served={served!r}; expected an int >= 0")
        self._served = served
        self._last = None


class _Draws(Iterator[list[int]]):
    """``iter(GlobalBatchSampler)``: each ``next()`` draws the current step's share.

    A draw that raises leaves it usable: the next ``next()`` reads the share again.
    """

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self._sampler = sampler

    def __iter__(self) -> _Draws:
        return self

    def __next__(self) -> list[int]:
        return self._sampler._next()


def check_loader(obj: object) -> None:
    """Raise ``ConfigError`` unless ``obj`` can hand out data exactly once under live membership.

    Accepted: a ``DataLoader`` with ``num_workers=0`` whose ``batch_sampler`` is a
    :class:`GlobalBatchSampler` (or implements :class:`IndexedLoader`); an object implementing
    :class:`IndexedLoader`; an object implementing :class:`ReshardableLoader`. The error names the
    loader's type and the two ways to take part.
    """
    ways = (
        "implement indices_for(step, index, count) -> Sequence[int] (a pure function of the "
        "step and this member's share; GlobalBatchSampler is one), or state_dict() / "
        "load_state_dict() plus reshard(index, count), which is called on every membership change"
    )
    if isinstance(obj, DataLoader):
        sampler = obj.batch_sampler
        if isinstance(obj.sampler, GlobalBatchSampler) or (
            isinstance(sampler, BatchSampler) and isinstance(sampler.sampler, GlobalBatchSampler)
        ):
            raise ConfigError(
                "DataLoader got the GlobalBatchSampler as sampler=, which wraps it in a "
                "BatchSampler; pass it as DataLoader(dataset, batch_sampler=sampler)"
            )
        if not isinstance(sampler, IndexedLoader):
            raise ConfigError(
                f"DataLoader with batch_sampler {type(sampler).__name__} cannot re-split a step "
                "when a replica is lost. Use DataLoader(dataset, batch_sampler="
                f"GlobalBatchSampler(...)) (handle.sampler(B)), or {ways}"
            )
        if obj.num_workers > 0:
            raise ConfigError(
                f"DataLoader(num_workers={obj.num_workers}) draws "
                f"{obj.num_workers * (obj.prefetch_factor or 2)} batches ahead of the step, "
                "before a membership change can be seen; use num_workers=0 with this "
                "batch_sampler (parallelise inside the dataset instead)"
            )
        return
    if isinstance(obj, (IndexedLoader, ReshardableLoader)):
        return
    raise ConfigError(
        f"live membership cannot keep data exactly once with a {type(obj).__name__} loader: a "
        f"position-only iterator cannot be re-split when a replica is lost. Either {ways}"
    )

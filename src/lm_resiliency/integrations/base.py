"""The seam between ``enable_resiliency`` and the framework adapters.

An adapter says, for one rank, what that rank's unique recovery state is, how
to put it back, where the training-step boundary is and which ranks hold what.
It never monkeypatches the framework. ``enable_resiliency`` finds the adapter
with :func:`lm_resiliency.integrations.registry.adapter_for` and drives it.

Call order (every rank; the handle does all of it)::

    adapter = adapter_for(model, optimizer)      # detect by type, import lazily
    layout = adapter.parallel_layout()           # once: the checkpoint group, HSDP replicas
    adapter.validate_capture()                   # once, before recovery (cheap checks)
    # recovery (collective): the manager loads the tree captured below, then
    adapter.load_state_dict(tree["adapter"])     # every rank, same step
    adapter.load_rank_state_dict(tree["rank"]["adapter"])
    unbind = adapter.bind(boundary)              # connect the step boundary
    ...
    # at every interval-th boundary, on the training thread, after the step:
    tree = {"adapter": adapter.state_dict(), "rank": {"adapter": adapter.rank_state_dict(), ...}}
    ...
    unbind(); adapter.close()

A framework that owns the training loop (a ``Trainer``, an engine whose
``step()`` is not a torch optimizer's) builds its adapter itself when its
objects exist and calls ``lm_resiliency.frontdoor.enable.enable_adapter(adapter,
config=..., load_fallback=..., state=..., restore_rng=...)``; its ``bind``
stores the boundary and its own callbacks call ``before_step()`` (before the
parameters change) and ``after_step()`` (once per completed step, at the point
where everything the next step depends on is settled). ``restore_rng`` defers
the generators' restore when the framework draws from them between the
restore and its first step (see ``frontdoor/hf.py``).

What the handle adds itself (adapters must not capture it again): every RNG
the step draws from (torch CPU and every CUDA generator, Python ``random``,
NumPy's global generator), the step count and the caller's ``state`` objects.

Collectiveness: ``load_state_dict`` may issue collectives (it runs on every
rank at the same point, e.g. to re-establish DDP's bucket layout); the other
methods are local and cheap. ``state_dict`` runs on the training thread right
after a step and must only *reference* tensors (they are copied asynchronously
before the next step modifies them); it must never gather across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from lm_resiliency.errors import ConfigError

__all__ = [
    "Adapter",
    "AdapterBase",
    "DurableCandidate",
    "DurableCandidates",
    "DurableFallback",
    "ParallelLayout",
    "StepBoundary",
    "Unbind",
]

DurableFallback = Callable[[], "int | None"]
"""The framework's own durable-checkpoint loader: restores in place, returns the step or None."""

DurableCandidate = Callable[[int], None]
"""Writes the framework's durable checkpoint of the live state as SCOUT's candidate of ``step``
(``save_durable(step)``); runs on every rank at the same step."""


@runtime_checkable
class DurableCandidates(Protocol):
    """A :data:`DurableCandidate` writer that also hears each candidate's fate.

    Call order, every call on every rank, on the training thread, at the same step:
    ``writer(step)`` when ``step`` becomes SCOUT's ``CANDIDATE``; later exactly one of
    ``verified(step)`` (it became ``RECOVERY_VERIFIED``: it may now become what the
    durable fallback loads) or ``rejected(step)`` (an SDC was found before it was
    verified: the fallback must never load it), or neither (the job ended first, or a
    recovery abandoned its timeline: it stays a candidate, never loaded). The writer
    decides which rank touches shared files.
    """

    def __call__(self, step: int) -> None: ...

    def verified(self, step: int) -> None: ...

    def rejected(self, step: int) -> None: ...


Unbind = Callable[[], None]
"""Undoes :meth:`Adapter.bind` (removes the hooks or callbacks it installed)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Which ranks checkpoint together and which hold identical state.

    ``group``: the ranks that checkpoint together (``None``: the default group,
    or a single process without one). ``replica_ranks``: HSDP-style natural
    replicas, the ranks (numbered in ``group``) whose model and optimizer
    shards are byte-identical to this rank's, this rank included; ``None``
    when there are none. ``replica_group``: a process group of exactly those
    ranks (the handle gathers every member's per-rank state through it, so a
    rank restored from a replica's slot finds its own RNG and data position).
    ``comparison_groups``: for SCOUT, every group of ranks holding identical
    replicas of the same parameters (data-parallel peers), in ``group``
    numbering; empty when unknown.
    """

    group: dist.ProcessGroup | None = None
    replica_ranks: tuple[int, ...] | None = None
    replica_group: dist.ProcessGroup | None = None
    comparison_groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.replica_ranks is not None and len(self.replica_ranks) < 2:
            raise ValueError(
                f"replica_ranks={self.replica_ranks} must name at least two ranks "
                "(this rank and a replica) or be None"
            )
        if (self.replica_ranks is None) != (self.replica_group is None):
            raise ValueError("replica_ranks and replica_group must be given together")


@runtime_checkable
class StepBoundary(Protocol):
    """The training-step boundary the handle reacts to (given to :meth:`Adapter.bind`).

    ``before_step()``: the parameters are about to be modified (waits for the
    capture in flight, so a capture is never torn). ``after_step()``: one
    training step completed on this rank (counts it; at every ``interval``-th
    step runs SCOUT's gate and launches the capture). Both run on the training
    thread, in that order, once per step; both are local (no collectives),
    except what a capture itself does in the background.

    ``optimizer_done()``: for a framework whose step finishes *after* its
    optimizer (DeepSpeed's engine advances its scheduler and counters, a
    Megatron loop steps its scheduler) and whose ``after_step`` therefore comes
    late, at the next forward: called right after the optimizer update, before
    the training loop fetches the next batch. The state the handle captures
    itself (the RNGs, the ``state`` objects, per-rank extras) is taken there;
    the adapter's own state at ``after_step``. Adapters whose ``after_step``
    comes at the optimizer step need not call it.
    """

    def before_step(self) -> None: ...

    def optimizer_done(self) -> None: ...

    def after_step(self) -> None: ...


@runtime_checkable
class Adapter(Protocol):
    """One framework's view of one rank's recovery state. See the module doc for the order."""

    framework: str
    """``"torch"``, ``"ddp"``, ``"fsdp2"``, ``"hsdp"``, ``"hf"``, ``"deepspeed"``, ..."""

    capture_before_scheduler_step: bool
    """Whether ``after_step`` (the capture) comes before the loop's ``scheduler.step()``:
    true for the optimizer-hook boundary (the plain loop steps its LR schedulers after
    ``optimizer.step()``), so the ``state=`` schedulers are replayed on restore; false
    where the step ends after the framework's own scheduler step (DeepSpeed, Megatron,
    the HF ``Trainer``)."""

    def step_optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """Torch optimizers whose ``step()`` marks the boundary (after all of them stepped once)."""
        ...

    def bind(self, boundary: StepBoundary) -> Unbind:
        """Call ``boundary.before_step()``/``after_step()`` at this framework's step boundary.

        :class:`AdapterBase` does it with the public step pre-/post-hooks of
        :meth:`step_optimizers`; frameworks that own the loop (a ``Trainer``, an
        engine whose optimizer is not a torch optimizer) use their own callbacks.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's unique recovery state after a step (replica-identical under HSDP).

        Tensors (may be on device, may be views of live storage) and plain
        values; only what cannot be derived; never gathered across ranks.
        """
        ...

    def capture_state(self) -> dict[str, Any]:
        """What a capture at the step boundary holds: :meth:`state_dict`'s tree.

        Called on the training thread. Subtrees may be :class:`~lm_resiliency.state.Deferred`
        functions the capture worker calls before its copy (before the next
        ``optimizer.step()``): they may read only what does not change until then
        (parameters, optimizer state); what the next forward or an LR scheduler changes
        is taken here. :class:`AdapterBase` returns ``state_dict()``.
        """
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore in place onto the live objects; re-derive derived state.

        Every rank calls it at the same point (it may issue collectives).
        Raises :class:`~lm_resiliency.errors.ConfigError` naming what changed when
        the state was captured under another world, mesh or placement.
        """
        ...

    def rank_state_dict(self) -> dict[str, Any]:
        """Per-rank extras that differ between HSDP replicas (data position, ...); often ``{}``."""
        ...

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rank_state_dict` returned (this rank's own part)."""
        ...

    def validate_capture(self) -> None:
        """Cheap checks at enable time (unsupported configuration); raise ``ConfigError``."""
        ...

    def parallel_layout(self) -> ParallelLayout:
        """The checkpoint group and natural replicas of this rank."""
        ...

    def durable_fallback(self) -> DurableFallback | None:
        """The framework's own durable-checkpoint loader, or ``None`` (the caller's is used)."""
        ...

    def durable_candidate(self) -> DurableCandidate | None:
        """The framework's durable-candidate writer (SCOUT's dynamic catalogs), or ``None``.

        Called on every rank, on the training thread, at the capture boundary whose
        step became SCOUT's ``CANDIDATE``, with the model and optimizer equal to that
        capture. With SCOUT's pipelined verdict (the default) that is the pre-step hook
        of the next step: what the next forward changed (the data position, counters
        advanced before the optimizer step) is newer than the capture, so a writer
        takes those from the capture it saw (TorchTitan's adapter does). It must not
        move the framework's "latest" pointer: a candidate can still be rejected, and
        the durable fallback must never load a rejected one. A
        :class:`DurableCandidates` writer is also told when the candidate is verified
        (then it may make it loadable) or rejected. Called once, on every rank, by
        ``enable_adapter`` when SCOUT has an enabled dynamic catalog and no
        ``save_durable`` was given (it may raise ``ConfigError`` for a configuration
        it cannot write candidates for).
        """
        ...

    def modules(self) -> Sequence[torch.nn.Module]:
        """The modules SCOUT derives its recipes from (the unwrapped model)."""
        ...

    def close(self) -> None:
        """Remove whatever the adapter installed (hooks); idempotent."""
        ...


def bind_optimizer_hooks(
    optimizers: Sequence[torch.optim.Optimizer], boundary: StepBoundary
) -> Unbind:
    """The default step boundary: public ``torch.optim.Optimizer`` step hooks.

    ``register_step_pre_hook`` runs before an optimizer modifies its parameters,
    ``register_step_post_hook`` right after; both are per-instance public API, so
    nothing of torch is patched. With several optimizers the boundary is reached
    when each of them stepped once since the previous one.

    Installs the hooks; returns the function that removes them. Raises ``ConfigError``.
    """
    if not optimizers:
        raise ConfigError(
            "no optimizer to hook: pass the optimizer, e.g. enable_resiliency(model, optimizer)"
        )
    ids = [id(o) for o in optimizers]
    if len(set(ids)) != len(ids):
        raise ConfigError("the same optimizer was given twice; pass each optimizer once")
    pending: set[int] = set()

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        boundary.before_step()

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending.add(id(opt))
        if len(pending) == len(ids):
            pending.clear()
            boundary.after_step()

    handles = []
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))

    def unbind() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    return unbind


class AdapterBase:
    """Defaults for an :class:`Adapter`: optimizer-hook boundary, no per-rank extras.

    Subclasses set ``framework`` and implement ``state_dict``/``load_state_dict``
    and ``modules``; they override the rest only when their framework differs.
    """

    framework = "base"
    capture_before_scheduler_step = True

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)

    def step_optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return list(self._optimizers)

    def bind(self, boundary: StepBoundary) -> Unbind:
        """Public optimizer step hooks: pre-hook waits, the last post-hook of a step counts.

        With several optimizers the step is complete once every one of them
        stepped since the previous boundary (e.g. a GAN's two optimizers).
        """
        return bind_optimizer_hooks(self.step_optimizers(), boundary)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def capture_state(self) -> dict[str, Any]:
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def rank_state_dict(self) -> dict[str, Any]:
        return {}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(
                f"{type(self).__name__} captured no per-rank state but was given keys "
                f"{sorted(state)}; the checkpoint was written by another adapter"
            )

    def validate_capture(self) -> None:
        return None

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout()

    def durable_fallback(self) -> DurableFallback | None:
        return None

    def durable_candidate(self) -> DurableCandidate | None:
        return None

    def modules(self) -> Sequence[torch.nn.Module]:
        raise NotImplementedError

    def close(self) -> None:
        return None

"""``enable_resiliency``: one call that gives a training script every tier."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from lm_resiliency.checkpointing.manager import InMemoryCheckpointManager
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection import ComparisonGroups, Scout, ScoutConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import FaultInjector
from lm_resiliency.frontdoor.boundary import CaptureBoundary, WaitOnly
from lm_resiliency.frontdoor.handle import ResiliencyHandle
from lm_resiliency.frontdoor.live import (
    LiveSession,
    adapter_state_tensors,
    check_live,
    live_gemini_config,
)
from lm_resiliency.frontdoor.live_exit import (
    exit_on_membership_loss,
    finished_process,
    leave_process,
)
from lm_resiliency.frontdoor.objects import StateObjects
from lm_resiliency.frontdoor.resiliency_config import ResiliencyConfig
from lm_resiliency.frontdoor.resume import RecoveryInfo, resume, resume_from_framework
from lm_resiliency.frontdoor.schedulers import SchedulerReplay
from lm_resiliency.frontdoor.transact import attach_faults, build_mtgs, check_faults
from lm_resiliency.frontdoor.tree import CaptureTree
from lm_resiliency.frontdoor.validate import check_mtgs, check_scout, gemini_config, split_config
from lm_resiliency.integrations.base import Adapter, DurableCandidates, Unbind
from lm_resiliency.integrations.registry import adapter_for
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.spare import SPARE_ENV
from lm_resiliency.live.view import CoordinatorLost, Evicted, ReplicaTaken, RunFinished
from lm_resiliency.rng import restore_rng as restore_now
from lm_resiliency.transactions.mtgs_config import MTGSConfig

__all__ = ["enable_adapter", "enable_resiliency"]

log = logging.getLogger(__name__)


def enable_resiliency(
    model: Any,
    optimizer: Any = None,
    *,
    interval: int = 10,
    load_fallback: Callable[[], int | None] | None = None,
    save_durable: Callable[[int], None] | None = None,
    state: Mapping[str, Any] | None = None,
    config: InMemoryCkptConfig | ResiliencyConfig | None = None,
    mtgs: MTGSConfig | None = None,
    scout: ScoutConfig | None = None,
    failure_kind: str | None = None,
    faults: FaultInjector | None = None,
    live: LiveConfig | None = None,
) -> ResiliencyHandle:
    """Recover the newest common state, then capture every ``interval`` steps automatically.

    Collective: call it on every rank after the process group, the model and
    the optimizer exist, before the first training step. ``model`` is a plain
    ``nn.Module``, a ``DistributedDataParallel``, an FSDP2 (``fully_shard``)
    model; ``optimizer`` one optimizer or a list (the step ends when each
    stepped). What is captured after every ``interval``-th ``optimizer.step()``:
    the model and optimizer state (through the framework adapter), every RNG
    the next step draws from, the step count, and ``state[name].state_dict()``
    of each object in ``state`` (a data loader, a sampler, a scheduler, a
    ``GradScaler``). On enable it recovers: the newest step every rank can load
    is applied to all of them (``handle.start_step``); when no GEMINI step is
    common to all ranks, ``load_fallback()`` runs on every rank, restores the
    durable checkpoint itself and returns its step (or ``None``: fresh start).
    ``save_durable(step)``, its partner, writes that durable checkpoint of the live
    state when SCOUT makes ``step`` a ``CANDIDATE`` of a dynamic catalog
    (``ScoutConfig(catalog=...)``, e.g. MoE experts): on every rank, on the training
    thread, right after the capture of ``step``; keep it asynchronous, and keep it from
    becoming what ``load_fallback`` loads until it is verified (the handle's
    ``manager.find_latest(RecoveryMode.RECOVERY_VERIFIED)``). A ``save_durable`` with
    ``verified(step)`` and ``rejected(step)`` methods (the
    :class:`~lm_resiliency.integrations.base.DurableCandidates` protocol) is also told
    each candidate's fate, at the check that decides it. Framework adapters that own
    durable checkpoints (TorchTitan, DeepSpeed) bring their own.

    ``interval`` overrides ``config.interval``. ``config`` may also be a
    :class:`ResiliencyConfig` holding all three tiers (``gemini``, ``mtgs``, ``scout``); a
    tier given there and as its own argument raises ``ConfigError``.
    ``mtgs=MTGSConfig(...)`` makes each step a transaction through
    :meth:`ResiliencyHandle.train_step` (DDP only). ``scout=ScoutConfig(...)`` runs a SCOUT
    check before every capture at the same boundary (a capture is taken only when it is
    accepted, and certified as docs/scout.md "Certification" says;
    ``handle.last_scout`` is the latest result) and makes the recovery on enable follow the
    failure kind: ``failure_kind`` (``"sdc"``, ``"inaccessible"``, ``"straggler"``,
    ``"hang"``, ``"unknown"``) or ``$LM_RESILIENCY_FAILURE_KIND`` (an orchestrator's
    verdict), and a verdict SCOUT persisted before the restart.
    ``faults=FaultInjector(schedule, rank=rank)`` (armed: ``arm()`` or
    ``LM_RESILIENCY_FAULTS=1``; needs ``mtgs=``) injects the schedule's faults into the
    transaction's steps, for drills and tests: the injector's hooks are installed on the
    model and optimizer unless already installed (and removed by ``handle.close()``), and
    MTGS tells it each step and attempt.
    ``live=LiveConfig(...)`` (needs ``mtgs=``; run under ``lm-resiliency launch``): each
    replica group survives the loss of another without restarting; the step in flight is
    redone exactly once under the new membership (docs/live-membership.md). Feed data through
    ``DataLoader(ds, batch_sampler=handle.sampler(B, len(ds), seed))`` with ``num_workers=0``
    and draw the batch inside the closure, so a redone step re-splits the same global batch;
    ``handle.membership`` says the epoch, the members and the last change. Faults are then
    numbered by replica id.

    Raises ``ConfigError`` for invalid or incompatible arguments (before any
    collective), ``StateEncodingError`` naming the key path of a ``state``
    value that cannot be captured, ``NoConsistentStep`` or the fallback's own
    errors from recovery.
    """
    gemini, mtgs, scout, live = split_config(config, mtgs, scout, live)
    cfg = gemini_config(gemini, interval)
    adapter = adapter_for(model, optimizer)
    return enable_adapter(
        adapter,
        config=cfg,
        load_fallback=load_fallback,
        save_durable=save_durable,
        state=state,
        mtgs=mtgs,
        scout=scout,
        failure_kind=failure_kind,
        faults=faults,
        live=live,
    )


def enable_adapter(
    adapter: Adapter,
    *,
    config: InMemoryCkptConfig,
    load_fallback: Callable[[], int | None] | None = None,
    save_durable: Callable[[int], None] | None = None,
    state: Mapping[str, Any] | None = None,
    mtgs: MTGSConfig | None = None,
    restore_rng: Callable[[dict[str, Any]], None] | None = None,
    scout: ScoutConfig | None = None,
    failure_kind: str | None = None,
    resumed_step: int | None = None,
    faults: FaultInjector | None = None,
    live: LiveConfig | None = None,
) -> ResiliencyHandle:
    """:func:`enable_resiliency` for an adapter built by the caller (framework integrations).

    ``config.interval`` is the capture cadence. ``restore_rng`` replaces the
    immediate restore of the generators (a framework that draws from them
    between the restore and its first step defers it). ``resumed_step``: the
    framework already restored its own durable checkpoint of that step, at the
    user's request (``Trainer.train(resume_from_checkpoint=...)``); no GEMINI
    step is recovered over it (``source="fallback"``) and the captures continue
    from it. Collective, like :func:`enable_resiliency`.
    """
    mtgs_config = check_mtgs(mtgs, adapter)
    live_config = check_live(live, mtgs_config, scout)
    spare = live_config is not None and os.environ.get(SPARE_ENV) == "1"
    replica = _env_replica() if live_config is not None and not spare else None
    injector = check_faults(faults, mtgs_config, replica=replica, spare=spare)
    scout_config = check_scout(scout, adapter)
    if save_durable is not None and not callable(save_durable):
        raise ConfigError(
            f"save_durable={save_durable!r} must be a callable taking the candidate step, "
            "e.g. save_durable=lambda step: save_my_checkpoint(step)"
        )
    adapter.validate_capture()
    layout = adapter.parallel_layout()
    objects = StateObjects(state, complete_scaler_update=mtgs_config is None)
    # The plain loop steps its LR schedulers after the captured optimizer step: replayed.
    schedulers = SchedulerReplay(
        objects.items(), active=mtgs_config is None and adapter.capture_before_scheduler_step
    )
    group_rank = dist.get_rank(layout.group) if dist.is_initialized() else 0
    tree = CaptureTree(
        adapter,
        objects,
        layout,
        group_rank=group_rank,
        restore_rng=restore_rng or restore_now,
        schedulers=schedulers,
    )
    tree.validate()
    fallback = load_fallback if load_fallback is not None else adapter.durable_fallback()
    session: LiveSession | None = None
    if live_config is not None:
        with exit_on_membership_loss(replica=replica, cleanup=None, cleanup_timeout_s=0):
            # Registers and waits for epoch 0; a warm spare waits for a replica to take over.
            session = LiveSession.start(live_config, injector)
        if injector is not None and injector.rank != session.replica:
            log.info("faults renumbered for replica %d (taken over)", session.replica)
            injector.rank = session.replica  # live faults are numbered by replica
        config = live_gemini_config(config, session.replica)
    try:
        manager = _manager(config, layout.group, layout.replica_ranks, fallback)
    except BaseException:
        if session is not None:
            session.close()
        raise
    checker: Scout | None = None
    installed = False
    try:
        healed: tuple[int, float] | None = None
        if session is not None and session.membership.joining:
            # A restarted replica: healed by a member; its own (stale) memory is not recovered.
            healed = session.join(tree)
        if scout_config is not None:
            candidate = save_durable
            if candidate is None and _has_candidates(scout_config):
                candidate = adapter.durable_candidate()
            checker = _scout(scout_config, adapter, layout, manager, candidate)
        if healed is not None:
            recovery = RecoveryInfo(
                healed[0], "heal", ("heal",) * manager.world_size, healed[1], None
            )
        elif resumed_step is None:
            recovery = resume(
                manager, tree.apply, fallback, scout=checker, failure_kind=failure_kind
            )
        else:
            recovery = resume_from_framework(manager, resumed_step)
        if session is not None and healed is None:
            session.agree_start(recovery.step or 0)
        boundary = CaptureBoundary(
            manager,
            interval=config.interval,
            start_step=recovery.step or 0,
            build_tree=tree.build,
            rank_part=tree.per_rank,
            schedulers=schedulers,
        )
        if checker is not None:
            boundary.gates.append(checker.before_capture)
            boundary.after_capture.append(checker.after_capture)
            boundary.between.append(checker.post_check)  # pipelined like the boundary's
            boundary.before.append(checker.resolve)  # each verdict known after the next step
        txn = None
        if mtgs_config is not None:
            # After the recovery: the DDP bucket replay runs through DDP's default hook.
            if injector is not None:
                installed = attach_faults(injector, adapter)
            txn = build_mtgs(
                adapter,
                objects,
                mtgs_config,
                committed_steps=boundary.step,
                faults=injector,
                reducer=session.build_reducer() if session is not None else None,
                max_membership_changes=(
                    session.config.changes_per_step(session.membership.replicas)
                    if session is not None
                    else None
                ),
                later=session.data_state if session is not None else None,
            )
            if session is not None:
                session.bind(txn, adapter_state_tensors(adapter), tree)
                session.script(injector)
        unbind = adapter.bind(WaitOnly(boundary) if txn is not None else boundary)
        if installed:
            assert injector is not None
            unbind = _also_removing(unbind, injector)
        manager.commit_restore()  # applied and bound: only now is an own slot handed over
    except BaseException:
        if installed:
            assert injector is not None
            injector.remove()
        adapter.close()
        if checker is not None:
            checker.close()
        manager.close(finished=False)
        if session is not None:
            session.close()
            _leave_if_membership_lost(session)
        raise
    return ResiliencyHandle(
        manager=manager,
        adapter=adapter,
        boundary=boundary,
        unbind=unbind,
        recovery=recovery,
        mtgs=txn,
        scout=checker,
        live=session,
    )


def _leave_if_membership_lost(session: LiveSession) -> None:
    """Inside an ``except``: an ``Evicted``/``CoordinatorLost`` exits the process (76/75), a
    ``RunFinished`` (restarted after every member finished) exits 0."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (Evicted, CoordinatorLost, ReplicaTaken)):
        leave_process(exc, replica=session.replica, cleanup=None, cleanup_timeout_s=0)
    if isinstance(exc, RunFinished):
        finished_process(exc, replica=session.replica)


def _env_replica() -> int:
    raw = os.environ.get("LMR_REPLICA_GROUP", "")
    if not raw.strip().isdigit():
        raise ConfigError(
            f"LMR_REPLICA_GROUP={raw!r} must be this process's replica group id (0..R-1); "
            "lm-resiliency launch sets it (docs/live-membership.md §1)"
        )
    return int(raw)


def _also_removing(unbind: Unbind, injector: FaultInjector) -> Unbind:
    def both() -> None:
        try:
            unbind()
        finally:
            injector.remove()

    return both


def _has_candidates(config: ScoutConfig) -> bool:
    """Whether SCOUT makes durable candidates: a dynamic catalog, enabled (docs/scout.md)."""
    return config.enable and config.catalog is not None and config.dynamic.enabled


def _scout(
    config: ScoutConfig,
    adapter: Adapter,
    layout: Any,
    manager: InMemoryCheckpointManager,
    on_candidate: Callable[[int], None] | None,
) -> Scout:
    """SCOUT over the adapter's model and comparison groups, certifying ``manager``'s captures.

    A :class:`DurableCandidates` writer also hears each durable candidate's fate."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = ComparisonGroups.from_ranks(layout.comparison_groups, world_size=world)
    (model, *rest) = adapter.modules()
    if rest:
        log.info("SCOUT checks the first of %d model chunks", 1 + len(rest))
    return Scout(
        config,
        model,
        manager=manager.trust,
        groups=groups,
        interval=manager.config.interval,
        on_candidate=on_candidate,
        on_verified=on_candidate.verified if isinstance(on_candidate, DurableCandidates) else None,
        on_rejected=on_candidate.rejected if isinstance(on_candidate, DurableCandidates) else None,
    )


def _manager(
    config: InMemoryCkptConfig,
    group: dist.ProcessGroup | None,
    replica_ranks: tuple[int, ...] | None,
    fallback: Callable[[], int | None] | None,
) -> InMemoryCheckpointManager:
    kwargs: dict[str, Any] = {
        "group": group,
        "hsdp_replicated": replica_ranks is not None,
        "load_fallback": fallback,
    }
    # The replica-restore source (a rank whose memory is gone reads its replica peer's
    # slot) arrives with the manager's recovery-source protocol; pass the replicas
    # once the manager takes them.
    if replica_ranks is not None and "replica_ranks" in _manager_params():
        kwargs["replica_ranks"] = replica_ranks
    return InMemoryCheckpointManager(config, **kwargs)


def _manager_params() -> set[str]:
    return set(inspect.signature(InMemoryCheckpointManager.__init__).parameters)

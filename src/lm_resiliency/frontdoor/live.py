"""Live membership at the front door: ``enable_resiliency(..., live=LiveConfig())``.

What it wires (docs/live-membership.md §4, §5, §8):

* :func:`check_live` validates ``live=`` before anything collective: it needs ``mtgs=`` with
  ``two_phase_commit`` and a shadow, and the launcher's environment
  (``LMR_LIVE_COORDINATOR``); a job of one replica group logs the one line of §7 and keeps
  today's path.
* :class:`LiveSession` owns this process's :class:`~lm_resiliency.live.membership.Membership`
  and the :class:`~lm_resiliency.live.reducer.LiveReducer` MTGS reduces through. It is the
  sampler's :class:`~lm_resiliency.live.sampler.ShareSource` (step = the transaction's next
  step, index/count = the current members), so a step redone under a new membership
  re-splits the same global batch. It reseeds torch's generators at every attempt from
  ``(seed, step, index, count)``, writes the commit log (``mtgs.commit`` with the epoch, the
  members and, every ``digest_every`` commits, the state digest), fires the ``live.*`` kill
  points and the scripted ``leave@R:S``.
* GEMINI in live mode: every torchrun is its own world (``RANK`` 0 of 1 under N=1), so the
  memory namespace is the run id plus ``.r<replica>``; replication across replicas and the
  re-pairing at a change are not wired here (§7, a later phase).
* The fresh start: every replica publishes the step it recovered (``start/<r>`` on the
  coordinator store) and waits for the others'; replicas that recovered different steps are
  refused with the fix (their memory is not one state).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lm_resiliency._killpoints import kill_point
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection.digest import digest_tensors
from lm_resiliency.errors import ConfigError, ResiliencyError
from lm_resiliency.faults import FaultInjector
from lm_resiliency.faults.schedule import FaultKind
from lm_resiliency.live import heal
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import Heartbeat, decode
from lm_resiliency.live.membership import Change, Membership
from lm_resiliency.live.reducer import LiveReducer
from lm_resiliency.live.sampler import (
    GlobalBatchSampler,
    SampledBatch,
    Share,
    reseed_step,
    share_size,
    weight,
)
from lm_resiliency.live.spare import SPARE_ENV, Taken, wait_for_takeover
from lm_resiliency.live.view import CoordinatorLost, ReplicaTaken, RunFinished
from lm_resiliency.persistence.identity import RUN_ID_ENV
from lm_resiliency.telemetry import EventLog
from lm_resiliency.transactions.mtgs_config import MTGSConfig

if TYPE_CHECKING:
    from lm_resiliency.frontdoor.tree import CaptureTree
    from lm_resiliency.integrations.base import Adapter
    from lm_resiliency.transactions import MTGS, StepResult

__all__ = [
    "LiveSession",
    "LiveStatus",
    "adapter_state_tensors",
    "check_live",
    "live_gemini_config",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

COORDINATOR_ENV = "LMR_LIVE_COORDINATOR"
NO_REPLICA_DIMENSION = (
    "live membership off: the job has no replica dimension (FSDP shards the whole world); "
    "a lost rank restarts the job and recovers from memory"
)


def check_live(
    live: Any, mtgs: MTGSConfig | None, scout: Any, env: Mapping[str, str] | None = None
) -> LiveConfig | None:
    """``live`` validated against the other tiers and the environment; ``None``: live off.

    Local and before any collective. Raises ``ConfigError`` naming the problem and the fix.
    """
    if live is None:
        return None
    if not isinstance(live, LiveConfig):
        raise ConfigError(
            f"live must be a lm_resiliency.live.LiveConfig, got {type(live).__name__}; e.g. "
            "live=LiveConfig(lease_s=0.5)"
        )
    if mtgs is None:
        raise ConfigError(
            "live=LiveConfig(...) needs mtgs=MTGSConfig(...): the step lost with a replica is "
            "redone exactly once through the MTGS transaction; pass mtgs=MTGSConfig() too"
        )
    if not mtgs.two_phase_commit or not mtgs.shadow:
        raise ConfigError(
            f"live=LiveConfig(...) needs MTGSConfig(two_phase_commit=True, shadow=True), got "
            f"two_phase_commit={mtgs.two_phase_commit}, shadow={mtgs.shadow}: a survivor that "
            "applied the lost step must keep its shadow until the next epoch says whether any "
            "survivor confirmed it (docs/live-membership.md §4.3)"
        )
    if scout is not None:
        raise ConfigError(
            "scout=ScoutConfig(...) with live=LiveConfig(...) is not supported yet: SCOUT's "
            "comparison groups across replica groups are rebuilt per membership epoch in a "
            "later phase (docs/live-membership.md §7); leave scout=None in live mode"
        )
    env = os.environ if env is None else env
    if not env.get(COORDINATOR_ENV):
        raise ConfigError(
            f"live=LiveConfig(...) needs a membership coordinator, but {COORDINATOR_ENV} is not "
            "set: run the script under 'lm-resiliency launch --replica-groups R "
            "--nproc-per-group N -- train.py ...' (or set the variables of "
            "docs/live-membership.md §1 for a coordinator you started), or leave live=None"
        )
    if env.get("LMR_REPLICA_GROUPS", "").strip() == "1":
        log.warning(NO_REPLICA_DIMENSION)
        return None
    return live


def live_gemini_config(config: InMemoryCkptConfig, replica: int) -> InMemoryCkptConfig:
    """GEMINI's config with a memory namespace of this replica's own (``<run>.r<replica>``).

    Under the launcher every torchrun is its own world, so without this two replicas' rank 0
    would share one memory slot.
    """
    base = config.run_id or os.environ.get(RUN_ID_ENV) or os.environ.get("LMR_LIVE_RUN") or "live"
    return dataclasses.replace(config, run_id=f"{base}.r{replica}")


@dataclass(frozen=True)
class LiveStatus:
    """``handle.membership``: this replica's place in the current membership epoch."""

    epoch: int
    members: tuple[int, ...]
    replica: int
    """This process's replica id (``LMR_REPLICA_GROUP``)."""
    index: int
    """Its rank in the epoch's cross-replica group (``members.index(replica)``)."""
    weight: float
    """Its share of the global batch (``n_i / B``), the factor its gradient is scaled by."""
    last_change: Change | None
    """The last change adopted (reason, cause, effective step, timings), ``None`` before any."""


class LiveSession:
    """One process's live membership, its reducer, its share of the data and its commit log.

    Built by ``enable_resiliency`` (see the module doc); the training loop reaches it only
    through the handle (``handle.membership``, ``handle.sampler``, ``handle.batch_indices``).
    """

    def __init__(self, config: LiveConfig, membership: Membership) -> None:
        self.config = config
        self.membership = membership
        self.replica = membership.replica
        self.seed = 0
        self.global_batch: int | None = None
        self.sampler_obj: GlobalBatchSampler | None = None
        self.reducer: _KillPointReducer | None = None
        self.txn: MTGS | None = None
        self.leaves: frozenset[int] = frozenset()
        self.joins: dict[int, frozenset[int]] = {}
        """Replica -> the steps from which a scripted ``join@R:S`` makes it a member."""
        self._computed: tuple[int, tuple[int, ...]] | None = None
        self.data_state: dict[str, Any] = {}
        """MTGS's later data state (the sampler, once made): restored before every redo."""
        self.events = _events(config, membership)
        self._digest_of: Callable[[], tuple[int, dict[str, str]]] | None = None
        self._first: dict[str, str] | None = None
        """The first commit's ``first`` field (digests of the parameters the process started
        from), then None."""
        self._redo_start: float | None = None
        self._leaving = False
        self.capture: CaptureTree | None = None
        self._full = True
        """Whether the last epoch adopted held every replica (a loss clears it)."""
        self._loss_detected: float | None = None
        """The coordinator's detection time (wall clock) of the first loss since the world
        was last full: ``live.world_full`` reports the time from it."""
        self.taken: Taken | None = None
        """How this process became its replica, when it waited as a warm spare first."""

    @classmethod
    def start(cls, config: LiveConfig, faults: FaultInjector | None = None) -> LiveSession:
        """Register with the coordinator (waits, bounded, for epoch 0 or joins).

        A process that joins a running job asks to be healed at ``S - 1`` when the schedule
        scripts ``join@R:S`` for its replica (the first such item: one scripted rejoin per
        replica). A warm spare (``LMR_LIVE_SPARE=1``), or a restarted worker whose replica a
        spare took over (:class:`ReplicaTaken`), first waits for a replica to take over
        (:func:`~lm_resiliency.live.spare.wait_for_takeover`); ``LMR_REPLICA_GROUP`` is then
        set to the replica it became.
        """
        spare = os.environ.get(SPARE_ENV) == "1"
        own = None if spare else int(os.environ.get("LMR_REPLICA_GROUP", "0"))
        while True:
            taken = wait_for_takeover(config, own=own) if spare else None
            replica = taken.replica if taken is not None else own
            assert replica is not None
            joins = sorted(_scripted(faults, FaultKind.JOIN).get(replica, ()))
            try:
                membership = Membership.from_env(
                    config,
                    join_at=joins[0] - 1 if joins else 0,
                    replica=replica,
                    incarnation=taken.inc if taken is not None else "",
                )
            except ReplicaTaken as exc:
                log.warning("live membership: %s", exc)
                spare = True
                continue
            os.environ["LMR_REPLICA_GROUP"] = str(replica)
            session = cls(config, membership)
            session.taken = taken
            return session

    # -- wiring (enable_resiliency) ------------------------------------------------------

    def agree_start(self, step: int) -> None:
        """Every member publishes the step it recovered and checks the others recovered it too.

        Raises ``ConfigError`` when the replicas' memory holds different steps, and
        ``CoordinatorLost`` when the others do not answer within ``join_timeout_s``.
        """
        m = self.membership
        key = f"{m.keys.root}start/{m.epoch}/"
        self._ask(lambda s: s.set(f"{key}{self.replica}/{m.group_rank}", str(step)))
        wanted = [f"{key}{r}/{m.group_rank}" for r in m.members]
        deadline = time.monotonic() + self.config.join_timeout_s
        while not self._ask(lambda s: s.check(wanted)):
            if time.monotonic() > deadline:
                raise CoordinatorLost(
                    f"replicas {list(m.members)} did not all report their start step within "
                    f"join_timeout_s={self.config.join_timeout_s:g}"
                )
            time.sleep(self.config.poll_slice_s)
        got = self._ask(lambda s: s.multi_get(wanted))
        steps = {r: int(v) for r, v in zip(m.members, got, strict=True)}
        if len(set(steps.values())) > 1:
            raise ConfigError(
                f"live membership: the replicas recovered different steps from their memory "
                f"({', '.join(f'replica {r}: step {s}' for r, s in steps.items())}); they must "
                "start from one state. Remove the stale in-memory checkpoints (lm-resiliency "
                "clean --run RUN) or give the run a new id, then start again"
            )
        self.membership.set_committed(step)
        self._log("live.start", step=step, epoch=m.epoch, members=list(m.members))

    def build_reducer(self) -> LiveReducer:
        """The epoch's cross-replica group (collective over the members)."""
        self.reducer = _KillPointReducer(
            self,
            self.membership,
            self._weight_of,
            poll_slice_s=self.config.poll_slice_s,
            pg_timeout_s=self.config.pg_timeout_s,
        )
        return self.reducer

    def bind(
        self,
        txn: MTGS,
        state_tensors: Callable[[], dict[str, list[torch.Tensor]]],
        capture: CaptureTree | None = None,
    ) -> None:
        """Attach the transaction (the step source), the state the digest covers (its parts
        by name, :func:`adapter_state_tensors`), and the capture tree a donor serves to a
        joiner (``heal.at_boundary``)."""
        self.txn = txn
        self.capture = capture

        def digest() -> tuple[int, dict[str, str]]:
            parts = {name: digest_tensors(ts) for name, ts in state_tensors().items()}
            return combine_digests(parts.values()), {k: f"{v:016x}" for k, v in parts.items()}

        self._digest_of = digest
        # Where this process's training starts, for the first commit's record: the parameters
        # as bound (after init, recovery or a heal) and just before its first optimizer step.
        # A replica whose first commit disagrees shows which of the two already differed.
        self._first = {"params_at_bind": f"{digest_tensors(state_tensors()['params']):016x}"}

        def before_step(*_: Any) -> None:
            kill_point("live.before_step", step=self.step)
            if self._first is not None and "params_before_step" not in self._first:
                params = digest_tensors(state_tensors()["params"])
                self._first["params_before_step"] = f"{params:016x}"

        model = txn.model.module
        model.register_forward_pre_hook(lambda *_: kill_point("live.forward", step=self.step))
        txn.optimizer.register_step_pre_hook(before_step)

    def script(self, faults: FaultInjector | None) -> None:
        """The steps before which this replica leaves cleanly (``leave@R:S``) and the
        scripted joins (``join@R:S``: the members wait for R's admission after S - 1)."""
        self.leaves = frozenset(_scripted(faults, FaultKind.LEAVE).get(self.replica, ()))
        self.joins = _scripted(faults, FaultKind.JOIN)

    # -- ShareSource and the data --------------------------------------------------------

    @property
    def step(self) -> int:
        """The step being computed (the transaction's next step)."""
        return (self.txn.committed_steps if self.txn is not None else 0) + 1

    def current(self) -> Share:
        m = self.membership
        return Share(self.step, m.index, len(m.members), m.epoch, self.replica)

    def sampler(
        self, global_batch: int, dataset_len: int, seed: int = 0, *, steps: int | None = None
    ) -> GlobalBatchSampler:
        """A ``batch_sampler`` of this replica's share of every step (one per session)."""
        if self.sampler_obj is not None:
            raise ConfigError(
                "handle.sampler(...) was already called; one sampler per run (reuse it, or "
                "call handle.batch_indices(step) for a loader of your own)"
            )
        sampler = GlobalBatchSampler(
            dataset_len, global_batch, seed, self, steps=steps, on_batch=self._on_batch
        )
        share_size(global_batch, 0, self.membership.replicas)  # validates B >= 1 early
        if global_batch < self.membership.replicas:
            raise ConfigError(
                f"global_batch={global_batch} is smaller than the {self.membership.replicas} "
                "replica groups: a replica would get no sample; use a global batch of at least "
                "the replica count"
            )
        if self.step > 1:  # a healed joiner (or a resumed run): the next draw is this step's
            sampler.load_state_dict({**sampler.state_dict(), "served": self.step - 1})
        self.sampler_obj, self.global_batch, self.seed = sampler, global_batch, seed
        self.data_state["live_sampler"] = sampler
        if self.reducer is not None:
            self.reducer.reweigh()
        return sampler

    def batch_indices(self, step: int) -> list[int]:
        """This replica's sample ids of ``step`` under the current membership."""
        if self.sampler_obj is None:
            raise ConfigError(
                "handle.batch_indices(step) needs the global batch: call "
                "handle.sampler(global_batch, dataset_len, seed) once first"
            )
        m = self.membership
        return self.sampler_obj.indices_for(step, m.index, len(m.members))

    def _on_batch(self, batch: SampledBatch) -> None:
        self._log(
            "live.sample",
            step=batch.step,
            epoch=batch.epoch,
            index=batch.index,
            count=batch.count,
            indices=list(batch.indices),
        )

    def _weight_of(self, members: tuple[int, ...], replica: int) -> float:
        if self.global_batch is None:
            return 1.0 / len(members)
        n = share_size(self.global_batch, members.index(replica), len(members))
        return weight(n, self.global_batch, self.config.loss_reduction)

    # -- per step (the handle) -----------------------------------------------------------

    def wrap(self, closure: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The closure MTGS runs, reseeding torch's generators first (at every attempt)."""

        def reseeded(*args: Any) -> torch.Tensor:
            if not args or args[0] == 0:
                m = self.membership
                # The membership this attempt computes under: the commit log names it, also
                # when a later change finalises the step (another survivor confirmed it).
                self._computed = (m.epoch, m.members)
                reseed_step(
                    self.seed,
                    self.step,
                    m.index,
                    len(m.members),
                    python_and_numpy=self.config.reseed_all,
                )
            return closure(*args)

        return reseeded

    def before_step(self, close: Callable[[], None]) -> None:
        """Fire a scripted ``leave`` of this replica (it flags the epoch, closes, exits 0)."""
        step = self.step
        if step not in self.leaves:
            return
        self._log("live.leave", step=step)
        self._leaving = True
        self._await_peers_committed(step - 1)
        self.membership.report_failure("leave")
        close()
        rejoin = [s for s in self.joins.get(self.replica, ()) if s > step]
        if rejoin:
            log.warning(
                "live membership: replica %d leaves before step %d and rejoins at step %d "
                "(scripted): exit 1, so that its torchrun starts it again",
                self.replica,
                step,
                min(rejoin),
            )
        sys.stdout.flush()
        sys.stderr.flush()
        # A clean exit that runs no Gloo destructor of a group the peers still use; a scripted
        # rejoin exits 1 (torchrun restarts only a failed worker).
        os._exit(1 if rejoin else 0)

    def _await_peers_committed(self, step: int) -> None:
        """Wait (bounded by ``reform_timeout_s``) until every member's heartbeat shows ``step``.

        A clean leave happens at a step boundary all members have passed: this replica's
        confirmation of ``step`` may complete before a peer's (the ring still needs this
        process's sockets), and a ``fail/<E>`` flag written then would make that peer give
        the step up and the survivors redo it without the leaver, which is not what the
        script said (``leave@R:S`` leaves *before* S, after taking part in S - 1).
        """
        m = self.membership
        keys = [m.keys.heartbeat(r, m.group_rank) for r in m.members if r != self.replica]
        deadline = time.monotonic() + self.config.reform_timeout_s
        while keys and time.monotonic() < deadline:
            raw = self._ask(lambda s: s.multi_get(keys))
            beats = [decode(Heartbeat, b, key=k) for k, b in zip(keys, raw, strict=True)]
            if all(b.committed >= step for b in beats):
                return
            time.sleep(self.config.poll_slice_s)
        if keys:
            log.warning(
                "live membership: members did not all commit step %d within reform_timeout_s=%g "
                "before this replica's scripted leave; leaving anyway",
                step,
                self.config.reform_timeout_s,
            )

    def after_step(self, result: StepResult) -> None:
        """Log the commit (and its digest) and tell the heartbeat the newest committed step."""
        if not result.committed:
            return
        self.membership.set_committed(result.step)
        m = self.membership
        epoch, members = self._computed or (m.epoch, m.members)
        fields: dict[str, Any] = {
            "step": result.step,
            "epoch": epoch,
            "members": list(members),
            # Store requests of the training and watcher threads so far (the heartbeat
            # thread's are apart): a healthy step makes none (tests/faults/test_live_spare.py).
            "requests": m.requests,
        }
        if self._first is not None:  # this process's first commit: where it started from
            fields["first"], self._first = self._first, None
        if result.attempts > 1:  # what the step went through before this commit
            fields["attempts"] = result.attempts
            fields["aborts"] = [
                {"phase": a.phase, "reasons": {str(r): list(n) for r, n in a.reasons.items()}}
                for a in result.aborts
            ]
        every = self.config.digest_every
        if every and result.step % every == 0 and self._digest_of is not None:
            whole, parts = self._digest_of()
            fields["digest"] = f"{whole:016x}"
            fields["digest_parts"] = parts  # which part differs when replicas disagree
        if result.membership_changes:
            change = result.membership_changes[-1]
            fields["change"] = {
                "epoch": change.epoch,
                "outcome": change.outcome,
                "cause": change.cause,
                "reform_s": change.reform_ns / 1e9,
            }
            adopted = self.status().last_change
            if adopted is not None:  # the phases of the change (benchmarks/live.py, the demo)
                fields["change"].update(
                    reason=adopted.reason,
                    t_detect=adopted.t_detect,
                    t_publish=adopted.t_publish,
                    adopt_s=adopted.adopt_s,
                    rebuild_s=adopted.rebuild_s,
                )
            self._note_members()
        self._log("mtgs.commit", **fields)
        self._boundary(result.step)

    def _boundary(self, step: int) -> None:
        """Take part in an admission scheduled for ``step`` (one cached read otherwise)."""
        capture = self.capture
        if capture is None:
            return
        t0 = time.perf_counter()
        m = self.membership
        due = [r for r, steps in self.joins.items() if step + 1 in steps and r not in m.members]
        if due:
            self._await_scripted_admission(due, step)
        record = heal.at_boundary(self.membership, step, lambda: capture.build(step))
        if record is None:
            return
        assert self.reducer is not None
        self.reducer.adopt(record)
        self._log(
            "live.admission",
            step=step,
            epoch=record.epoch,
            reason=record.reason,
            cause=record.cause,
            members=list(record.members),
            donor=self.replica == min(self.membership.members),
            seconds=time.perf_counter() - t0,
        )
        self._note_members()

    def _await_scripted_admission(self, due: list[int], step: int) -> None:
        """A scripted ``join@R:step+1``: wait (bounded) until R's admission is scheduled."""
        deadline = time.monotonic() + self.config.join_timeout_s
        while self.membership.admission() is None:
            if time.monotonic() > deadline:
                raise CoordinatorLost(
                    f"replicas {due} are scripted to join at step {step + 1} but no admission "
                    f"was scheduled within join_timeout_s={self.config.join_timeout_s:g}"
                )
            if self.membership.failed() is not None:
                return  # a loss first: the next step's collective fails and reforms
            time.sleep(self.config.poll_slice_s)

    def _note_members(self) -> None:
        """Track losses and log ``live.world_full`` when every replica is a member again."""
        m = self.membership
        change = m.last_change
        full = len(m.members) == m.replicas
        if not full and self._full and change is not None:
            self._loss_detected = change.t_detect
        if full and not self._full:
            since = None if self._loss_detected is None else time.time() - self._loss_detected
            self._log("live.world_full", epoch=m.epoch, members=list(m.members),
                      since_loss_s=since, step=self.step - 1)  # fmt: skip
            if since is not None:
                log.info("live membership: full world again %.2f s after the loss", since)
            self._loss_detected = None
        self._full = full

    def status(self) -> LiveStatus:
        m = self.membership
        change = m.last_change
        if change is not None and self.reducer is not None:
            change = dataclasses.replace(change, rebuild_s=self.reducer.last_build_s)
        return LiveStatus(
            epoch=m.epoch,
            members=m.members,
            replica=self.replica,
            index=m.index,
            weight=self.reducer.weight if self.reducer is not None else 1.0 / len(m.members),
            last_change=change,
        )

    def join(self, capture: CaptureTree) -> tuple[int, float] | None:
        """A replica restarted after the run began: healed by a member, then admitted.

        Its own memory slot is stale and is not recovered from. It waits (bounded by
        ``join_timeout_s``) for an admission naming it, receives the donor's capture tree of
        step h, applies it through the restore path (``CaptureTree.apply``, what recovery
        applies), acks its digest and adopts the epoch that admits it. Returns ``(h,
        seconds)``: training goes on at h + 1. Returns None when every member left first and
        the coordinator started a fresh membership naming this process: it is a member then,
        and recovers from its own memory like every other. Raises ``CoordinatorLost`` (no
        admission in time) and ``HealFailed`` when the loaded state does not match the donor's.
        """
        self._log("live.joining", epoch=self.membership.epoch)
        if self.taken is not None:
            self._log("live.takeover", spare=self.taken.spare, waited_s=self.taken.waited_s,
                      assigned_t=self.taken.assigned_t)  # fmt: skip
        log.warning(
            "live membership: replica %d %s after the run began; it registered as a joiner "
            "and waits (at most join_timeout_s=%g s) to be healed and admitted",
            self.replica,
            "restarted" if self.taken is None else f"taken over by warm spare {self.taken.spare}",
            self.config.join_timeout_s,
        )
        t0 = time.perf_counter()

        def load(tree: Any) -> Any:
            step = capture.apply(tree)
            return capture.build(step)

        try:
            record, healed = heal.join(self.membership, load)
        except RunFinished as exc:
            self._log("live.run_finished", epoch=exc.epoch, step=exc.step)
            raise
        if healed is None:
            log.warning(
                "live membership: replica %d: every member left before it was healed; the "
                "coordinator started a fresh membership (epoch %d), so it recovers from its "
                "own memory",
                self.replica,
                record.epoch,
            )
            return None
        seconds = time.perf_counter() - t0
        self.membership.set_committed(healed.step)
        self._full = len(record.members) == self.membership.replicas
        self._log("live.healed", step=healed.step, epoch=record.epoch,
                  members=list(record.members), nbytes=healed.nbytes, seconds=seconds,
                  transfer_s=healed.transfer_s)  # fmt: skip
        log.info(
            "live membership: replica %d healed from a member at step %d (%.1f MB, transfer "
            "%.3f s) and admitted at epoch %d",
            self.replica,
            healed.step,
            healed.nbytes / 1e6,
            healed.transfer_s,
            record.epoch,
        )
        return healed.step, seconds

    def finish(self) -> None:
        """At the end of training: wait (bounded) until every member has finished too.

        A member that exits while another still waits for the last step's confirmation would
        be a lost replica to it: that one would redo the step alone, and the step would be
        committed twice under two memberships (seen by ``check_run``). So every member
        publishes ``done/<E>/<r>/<g>`` and waits, at most ``reform_timeout_s``, for the
        other members' before it leaves.
        """
        if self._leaving or self.membership.joining:
            return
        try:
            self.membership.finish(self.step - 1)
        except CoordinatorLost:
            log.warning("live membership: coordinator lost while finishing; leaving anyway")

    def close(self) -> None:
        self.membership.close()
        if self.events is not None:
            self.events.close()

    # -- internals -----------------------------------------------------------------------

    def _log(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.log(
                event, replica=self.replica, pid=os.getpid(), inc=self.membership.incarnation,
                **fields,
            )  # fmt: skip

    def _ask(self, request: Callable[[Any], _T]) -> _T:
        """One store request, bounded by the membership's store (``Membership.store``: a
        request to a stopped coordinator raises ``CoordinatorLost`` instead of hanging)."""
        return request(self.membership.store())


class _KillPointReducer(LiveReducer):
    """The live reducer with the ``live.*`` kill points of the collectives of a step."""

    def __init__(self, session: LiveSession, *args: Any, **kwargs: Any) -> None:
        self._session = session
        super().__init__(*args, **kwargs)

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        fut = super().allreduce(tensor)
        txn = self._session.txn
        if txn is not None:
            step, hook = self._session.step, txn.hook
            if hook.vote_cast and hook.reduced_codes() is not None:
                kill_point("live.confirm", step=step)  # the commit confirmation is in flight
            elif hook.vote_cast:
                kill_point("live.vote", step=step)  # this rank's vote left with the last bucket
            elif hook.buckets_launched == 1:
                kill_point("live.bucket_allreduce", step=step)
        return fut

    def reweigh(self) -> None:
        """Recompute this replica's weight (the global batch became known)."""
        self._weight = float(self.weight_fn(self.members, self.view.replica))


def _scripted(faults: FaultInjector | None, kind: FaultKind) -> dict[int, frozenset[int]]:
    """Replica -> the steps of the job schedule's ``kind`` items (``leave``/``join``) for it.

    The job's schedule, not the injector's own items: a member waits for other replicas'
    scripted joins.
    """
    out: dict[int, set[int]] = {}
    for f in faults.job_schedule if faults is not None else ():
        if f.kind is kind:
            out.setdefault(f.rank, set()).add(f.step)
    return {r: frozenset(s) for r, s in out.items()}


def adapter_state_tensors(adapter: Adapter) -> Callable[[], dict[str, list[torch.Tensor]]]:
    """The tensors the commit log's digest covers, by part: ``params``, ``buffers``, ``optim``.

    The optimizer state is taken in parameter-group order (each parameter's entries by key),
    not in the order ``optimizer.state`` happened to gain them: two replicas holding the same
    state get the same digest however their optimizer state was created (a first step, a
    rollback's refill, a heal's ``load_state_dict``).
    """

    def tensors() -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        optim: list[torch.Tensor] = []
        for module in adapter.modules():
            params += [t.detach() for t in module.parameters()]
            buffers += [t.detach() for t in module.buffers()]
        for opt in adapter.step_optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    optim += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
        return {"params": params, "buffers": buffers, "optim": optim}

    return tensors


def combine_digests(parts: Iterable[int]) -> int:
    """One 64-bit digest of several (the parts' digests, in order)."""
    words = [v - (1 << 64) if v >= 1 << 63 else v for v in parts]  # as signed int64
    return digest_tensors([torch.tensor(words, dtype=torch.int64)])


def _events(config: LiveConfig, membership: Membership) -> EventLog | None:
    folder = os.environ.get("LMR_LIVE_EVENTS")
    if not folder:
        return None
    name = f"events-replica-{membership.replica}-rank-{membership.group_rank}.jsonl"
    return EventLog(Path(folder) / name, rank=membership.group_rank)


def require_session(session: LiveSession | None, what: str) -> LiveSession:
    if session is None:
        raise ResiliencyError(
            f"{what} needs live membership: pass live=LiveConfig(...) to enable_resiliency and "
            "run under lm-resiliency launch"
        )
    return session

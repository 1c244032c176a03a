"""What a demo run's records say: the fault, the recovery, its phases, the outcome.

Phases of a recovery, from the records of the workers (wall clock, one machine):

* ``detection``: the SIGKILL -> the first survivor noticed (its collective failed,
  or torchrun's agent sent it SIGTERM, whichever came first);
* ``restart``: that moment -> the first process of the new worker group started
  (survivors exit, the agent re-runs the rendezvous and spawns);
* ``startup``: new processes started -> every manager ready (interpreter and
  imports, process group, manager construction: run id, topology, replication
  edges);
* ``agreement``: the slowest rank's ``find_latest()``;
* ``load``: the slowest rank's ``load()`` plus applying the state and priming DDP;
* ``total``: the SIGKILL -> the last rank finished its first step after recovery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RecoverySummary", "RunSummary", "summarize"]

PHASES = ("detection", "restart", "startup", "agreement", "load")


@dataclass(frozen=True)
class RecoverySummary:
    """One recovery: which step, from where, at what cost."""

    step: int
    sources: dict[int, str]
    """Rank -> where its state came from (``own memory``, ``own disk``, ``peer memory``, ...)."""
    bytes_moved: int
    walked_back_from: list[int]
    fault_step: int | None
    fault_rank: int | None
    phases_s: dict[str, float] = field(default_factory=dict)
    total_s: float | None = None

    @property
    def lost_steps(self) -> int | None:
        """Optimizer steps redone: the fault step minus the recovered step."""
        return None if self.fault_step is None else self.fault_step - self.step


@dataclass(frozen=True)
class RunSummary:
    """Everything the parent reports about one run."""

    last_step: int
    """The newest step rank 0 reported training."""
    generations: int
    """Worker generations seen (1 + restarts)."""
    finished: dict[int, str]
    """Rank -> digest of its final state, for ranks that finished."""
    recovery: RecoverySummary | None
    sigterm_ranks: list[int]
    """Ranks whose SIGTERM handler ran after GEMINI's flush."""
    flushed_on_sigterm: dict[int, dict[str, Any]]
    """Rank -> the slots its signal flush persisted: role -> ``{"step", "state", "owner"}``."""
    peer_lost: dict[int, str]
    """Rank -> the error with which its collective failed."""


def _first(records: list[dict[str, Any]], event: str) -> dict[str, Any] | None:
    return next((r for r in records if r["event"] == event), None)


def summarize(records: list[dict[str, Any]]) -> RunSummary:
    """Summarize the records of one run (:func:`lm_resiliency.demo.events.read_run_events`)."""
    by = {
        name: [r for r in records if r["event"] == name] for name in {r["event"] for r in records}
    }
    steps = [int(r["step"]) for r in by.get("step", [])]
    before = {int(r["rank"]): dict(r.get("slots", {})) for r in by.get("sigterm", [])}
    flushed = {
        int(r["rank"]): _written(before.get(int(r["rank"]), {}), dict(r.get("slots", {})))
        for r in by.get("sigterm_flushed", [])
    }
    generations = {(r["rank"], r["attempt"], r["pid"]) for r in by.get("group_formed", [])}
    world = max((int(r.get("world_size", 0)) for r in by.get("group_formed", [])), default=0)
    return RunSummary(
        last_step=max(steps, default=0),
        generations=len(generations) // world if world else 0,
        finished={int(r["rank"]): str(r["digest"]) for r in by.get("finished", [])},
        recovery=_recovery(records, by),
        sigterm_ranks=sorted({int(r["rank"]) for r in by.get("sigterm", [])}),
        flushed_on_sigterm=flushed,
        peer_lost={int(r["rank"]): str(r["error"]) for r in by.get("peer_lost", [])},
    )


def _written(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Slots that became PERSISTED between the two records (what the signal flush wrote)."""
    return {
        role: slot
        for role, slot in after.items()
        if slot["state"] == "PERSISTED" and before.get(role) != slot
    }


def _recovery(
    records: list[dict[str, Any]], by: dict[str, list[dict[str, Any]]]
) -> RecoverySummary | None:
    recovered = by.get("recovered", [])
    if not recovered:
        return None
    last = {int(r["rank"]): r for r in recovered}  # records are in time order
    first = last[min(last)]
    fault = _first(records, "fault")
    fault_t = float(fault["t"]) if fault is not None else None
    phases: dict[str, float] = {}
    total = None
    if fault_t is not None:
        after = [r for r in records if float(r["t"]) >= fault_t]
        noticed = [float(r["t"]) for r in after if r["event"] in ("sigterm", "peer_lost")]
        started = [float(r["t"]) for r in after if r["event"] == "started"]
        ready = [float(r["t"]) for r in after if r["event"] == "manager_ready"]
        resumed = [float(r["t"]) for r in after if r["event"] == "resumed"]
        if noticed and started:
            phases["detection"] = min(noticed) - fault_t
            phases["restart"] = min(started) - min(noticed)
        if started and ready:
            phases["startup"] = max(ready) - min(started)
        phases["agreement"] = max(float(r["find_latest_s"]) for r in last.values())
        phases["load"] = max(float(r["load_s"]) + float(r["apply_s"]) for r in last.values())
        total = max(resumed) - fault_t if resumed else None
    return RecoverySummary(
        step=int(first["step"]),
        sources=dict(enumerate(str(s) for s in first["sources"])),
        bytes_moved=sum(int(r["bytes_moved"]) for r in last.values()),
        walked_back_from=[int(s) for s in first.get("walked_back_from", [])],
        fault_step=int(fault["step"]) if fault is not None else None,
        fault_rank=int(fault["rank"]) if fault is not None else None,
        phases_s=phases,
        total_s=total,
    )

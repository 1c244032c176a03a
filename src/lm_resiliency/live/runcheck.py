"""Invariants of a live-membership run, checked from its event logs (docs/live-membership.md §9).

``check_run(run_dir)`` reads every ``events-replica-<r>-rank-<g>.jsonl`` a run wrote (the
front door writes them when ``LMR_LIVE_EVENTS`` names the folder) and raises
``AssertionError`` naming the first broken invariant:

* the survivors' PIDs never change: every replica that committed the run's last step did so
  in the process that committed its first one, or, after it was lost, in processes that were
  healed and admitted (``live.healed``);
* each process's commit log is ``1, 2, ..., k``, or ``h+1, ..., k`` for a process healed at
  step ``h``: no step skipped or repeated per incarnation;
* every sample id of every committed step is consumed exactly once: the shares of the
  members that committed it, drawn under the epoch of the commit, together hold the step's
  global batch once (``stream=(seed, dataset_len, global_batch)`` also checks it is
  :func:`~lm_resiliency.live.sampler.global_indices` of the step);
* every replica's digest is the same after every commit (``LiveConfig(digest_every=1)``);
* every process trained from the committed state: the parameters it was bound with equal
  those before its first optimizer step, and those every member held after the step it
  started from (a heal's ``h``, a recovered step); the processes that started the run
  started from one state (the first commit's ``first`` field);
* with ``fallback=True`` (the coordinator was lost and every group restarted, §2.5): a
  process that logged ``live.start`` from a recovered step may commit again the steps after
  it that its predecessor committed, and the redo must end with the same digest; the PIDs
  change;
* with ``reference=`` (another run's :class:`LiveRun`), the final digest equals the
  reference's digest of the same step, bit for bit.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_resiliency.live.sampler import global_indices

__all__ = ["LiveRun", "check_run", "read_events"]


@dataclass
class LiveRun:
    """What :func:`check_run` found: per step, the commits; the final step and digest."""

    commits: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Step -> every replica's ``mtgs.commit`` record of it."""
    last_step: int = 0
    final_digest: str | None = None
    survivors: tuple[int, ...] = ()
    """The replicas that committed the last step."""
    lost: tuple[int, ...] = ()
    """The replicas that stopped committing before the last step."""
    pids: dict[int, list[int]] = field(default_factory=dict)
    """Replica -> the pids that wrote its events, in order of appearance."""
    healed: dict[int, int] = field(default_factory=dict)
    """Pid -> the step it was healed at (a restarted replica admitted again)."""
    world_full: list[dict[str, Any]] = field(default_factory=list)
    """The ``live.world_full`` records (every replica a member again after a loss)."""

    @property
    def rejoined(self) -> tuple[int, ...]:
        """The replicas with a healed incarnation."""
        return tuple(r for r, ps in sorted(self.pids.items()) if set(ps) & set(self.healed))

    def world_full_time(self) -> float:
        """The wall time (s) of the first ``live.world_full`` record."""
        return float(min(r["ts_ns"] for r in self.world_full)) / 1e9

    def digest_at(self, step: int) -> str | None:
        digests = {c.get("digest") for c in self.commits.get(step, [])}
        return next(iter(digests)) if len(digests) == 1 else None

    def members_at(self, step: int) -> tuple[int, ...]:
        return tuple(sorted(c["replica"] for c in self.commits.get(step, [])))

    def first_commit_time(self, step: int) -> float:
        """The wall time (s) of the first commit of ``step`` by any replica."""
        return float(min(c["ts_ns"] for c in self.commits[step])) / 1e9


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of every replica's event log, in file order per replica."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir).glob("events-replica-*-rank-*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def check_run(
    run_dir: str | Path,
    *,
    reference: LiveRun | None = None,
    stream: tuple[int, int, int] | None = None,
    fallback: bool = False,
) -> LiveRun:
    """Check the invariants of the module doc; returns the :class:`LiveRun` (``AssertionError``)."""
    records = read_events(run_dir)
    assert records, f"no live event log in {run_dir} (set LMR_LIVE_EVENTS to it)"
    run = LiveRun()
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_pid[r["pid"]].append(r)
        pids = run.pids.setdefault(r["replica"], [])
        if r["pid"] not in pids:
            pids.append(r["pid"])
    samples: dict[tuple[int, int, int], list[int]] = {}  # (pid, step, epoch) -> last draw
    starts: dict[int, int] = {}  # pid -> the step it started from (recovered), if it logged it
    for pid, recs in by_pid.items():
        start = next((r["step"] for r in recs if r["event"] == "live.start"), 0)
        starts[pid] = start
        steps = [r["step"] for r in recs if r["event"] == "mtgs.commit"]
        healed = [r["step"] for r in recs if r["event"] == "live.healed"]
        first = start + 1
        if healed:
            run.healed[pid] = healed[0]
            first = healed[0] + 1
        assert steps == list(range(first, first + len(steps))), (
            f"pid {pid} (replica {recs[0]['replica']}) started from step {first - 1} and "
            f"committed steps {steps}"
            + (" after its heal" if healed else "")
            + ": a step was skipped or repeated"
        )
        for r in recs:
            if r["event"] == "live.world_full":
                run.world_full.append(r)
            elif r["event"] == "live.sample":
                samples[(pid, r["step"], r["epoch"])] = list(r["indices"])
    latest: dict[tuple[int, int], dict[str, Any]] = {}  # (step, replica) -> its last commit
    for r in records:  # file order: a replica's restarted process comes after its predecessor
        if r["event"] != "mtgs.commit":
            continue
        old = latest.get((r["step"], r["replica"]))
        if old is not None and old["pid"] != r["pid"]:
            assert fallback and starts[r["pid"]] < r["step"], (
                f"step {r['step']} committed twice by replica {r['replica']} (pids {old['pid']} "
                f"and {r['pid']}), and not as the redo after a fallback restart"
            )
            assert old.get("digest") == r.get("digest"), (
                f"step {r['step']} of replica {r['replica']}: the redo after the fallback restart "
                f"(pid {r['pid']}) ended with digest {r.get('digest')}, the first commit (pid "
                f"{old['pid']}) with {old.get('digest')}"
            )
        latest[(r["step"], r["replica"])] = r
    for (step, _), r in sorted(latest.items()):
        run.commits.setdefault(step, []).append(r)
    assert run.commits, f"no commit in {run_dir}"
    run.last_step = max(run.commits)
    run.survivors = run.members_at(run.last_step)
    run.lost = tuple(sorted(set(run.pids) - set(run.survivors)))
    for replica in run.survivors:
        committing = {c["pid"] for s in run.commits.values() for c in s if c["replica"] == replica}
        committing -= set(run.healed)  # healed incarnations of a lost replica
        if fallback:  # every process restarted; each later one resumed from its memory
            committing = {p for p in committing if starts[p] == 0}
        assert len(committing) <= 1, (
            f"survivor replica {replica} committed from several processes {sorted(committing)}: "
            "its PID changed (a survivor was restarted)"
        )
    _check_starts(run, by_pid)
    for step in sorted(run.commits):
        commits = run.commits[step]
        replicas = [c["replica"] for c in commits]
        assert len(replicas) == len(set(replicas)), f"step {step} committed twice: {replicas}"
        epochs = {c["epoch"] for c in commits}
        members = {tuple(c["members"]) for c in commits}
        assert len(epochs) == 1 and len(members) == 1, (
            f"step {step} was committed under epochs {epochs} / members {members}"
        )
        assert members == {tuple(sorted(replicas))}, (
            f"step {step}: members {members} but committed by replicas {sorted(replicas)}"
        )
        digests = {c.get("digest") for c in commits}
        assert len(digests) == 1, f"step {step}: replicas' digests differ: {_disagreement(commits)}"
        (epoch,) = epochs
        drawn: list[int] = []
        for c in commits:
            key = (c["pid"], step, epoch)
            assert key in samples, (
                f"step {step}: replica {c['replica']} drew no batch in epoch {epoch}"
            )
            drawn += samples[key]
        twice = [i for i, n in Counter(drawn).items() if n > 1]
        assert not twice, f"step {step}: sample ids {twice[:10]} were consumed more than once"
        if stream is not None:
            seed, dataset_len, global_batch = stream
            batch = sorted(global_indices(seed, step, dataset_len, global_batch))
            assert sorted(drawn) == batch, (
                f"step {step}: the members consumed {len(drawn)} samples, not the step's global "
                f"batch of {global_batch} exactly once"
            )
    run.final_digest = run.digest_at(run.last_step)
    if reference is not None:
        ref = reference.digest_at(run.last_step)
        assert ref is not None, f"the reference run has no digest of step {run.last_step}"
        assert run.final_digest == ref, (
            f"final digest of step {run.last_step} is {run.final_digest}, the reference's {ref}"
        )
    return run


def _check_starts(run: LiveRun, by_pid: dict[int, list[dict[str, Any]]]) -> None:
    """Every process trained from the committed state. Its first commit's ``first`` holds the
    digests of its parameters as bound and just before its first optimizer step: the two are
    equal (nothing but the optimizer changes them), they are what every member held after
    the step it started from (a heal's h, a recovered step), and the processes that started
    the run (step 0) started from one state."""
    fresh: dict[str, list[int]] = defaultdict(list)
    for pid, recs in by_pid.items():
        first = next((r for r in recs if r["event"] == "mtgs.commit"), None)
        if first is None or "first" not in first:
            continue  # a log written before the field existed
        who = f"pid {pid} (replica {first['replica']})"
        bound = first["first"]["params_at_bind"]
        before = first["first"].get("params_before_step", bound)  # no optimizer step yet
        assert bound == before, (
            f"{who}: its parameters changed between enable_resiliency and its first optimizer "
            f"step ({bound} -> {before}; first commit: {first})"
        )
        start = first["step"] - 1  # the state it trained from: a heal's h, a recovered step
        if start == 0:
            fresh[bound].append(first["replica"])
            continue
        want = {(c.get("digest_parts") or {}).get("params") for c in run.commits.get(start, [])}
        want.discard(None)
        if len(want) == 1:  # else no digest of step s, or its disagreement is reported there
            (params,) = want
            assert bound == params, (
                f"{who} started from step {start} with parameters {bound}, not the {params} "
                f"every member held after step {start} (first commit: {first})"
            )
    assert len(fresh) <= 1, (
        f"the processes that started the run started from different parameters (digest: "
        f"replicas): {dict(fresh)}"
    )


def _disagreement(commits: list[dict[str, Any]]) -> str:
    """Which replicas hold which digest, which parts differ, and each commit's attempts."""
    by_digest: dict[str | None, list[int]] = defaultdict(list)
    for c in commits:
        by_digest[c.get("digest")].append(c["replica"])
    parts = [c.get("digest_parts") or {} for c in commits]
    names = sorted({k for p in parts for k in p})
    differ = [k for k in names if len({p.get(k) for p in parts}) > 1]
    groups = "; ".join(f"replicas {rs}: {d}" for d, rs in sorted(by_digest.items(), key=str))
    attempts = {c["replica"]: c.get("attempts", 1) for c in commits}
    first = {c["replica"]: c["first"] for c in commits if "first" in c}
    started = f"; first commits (where each started from): {first}" if first else ""
    return (
        f"{groups}; parts that differ: {differ or 'not logged'}; attempts per replica "
        f"{attempts}; epoch {commits[0].get('epoch')}, members {commits[0].get('members')}"
        f"{started}; records: {commits}"
    )

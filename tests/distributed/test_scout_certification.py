"""Certification on real Gloo ranks: the dynamic-catalog table (candidate, then verified; SDC
rejects the candidate and keeps the verified step), decided job-wide across comparison groups;
a restarted job recovers the verified step by itself; the recovery-decision table."""

from __future__ import annotations

from pathlib import Path

from scout_fixtures import Trainer, Verdicts, accepted, digest

from lm_resiliency import InMemoryCkptConfig, RecoveryMode
from lm_resiliency.detection import (
    FAILURE_KIND_ENV,
    ComparisonGroups,
    DynamicCatalog,
    FailureKind,
    RecipeClass,
    Scout,
    ScoutConfig,
    ScoutStatus,
    decide_recovery,
)
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.faults import ComputeFaults, PersistentSDC
from lm_resiliency.testing import run_distributed

INTERVAL = 5


def _manager(tmp: str, run_id: str, world: int) -> InMemoryCheckpointManager:
    cfg = InMemoryCkptConfig(
        interval=INTERVAL,
        disk_folder=tmp,
        disk_flush_interval=0,
        run_id=run_id,
        replication_jump=max(1, world // 2),
        replication_chunk_size=1 << 16,
        signal_flush=False,
    )
    return InMemoryCheckpointManager(cfg)


def _moe_scout(t: Trainer, manager: InMemoryCheckpointManager, world: int, cands: list) -> Scout:
    catalog = DynamicCatalog(t.model.experts, shapes=[[(8, 16)], [(16, 16)]])  # K = 2
    # The dense recipes are checked every step: a candidate becomes verified after its
    # second complete cycle only once the dense rotation (7 blocks, 4 signatures) has
    # also checked every dense recipe clean since; at 5-step intervals it would need 35.
    every_step = RecipeClass(interval=1)
    return Scout(
        ScoutConfig(dense=every_step, optimizer=every_step),
        t.net,
        manager=manager.trust,
        groups=ComparisonGroups.hsdp(world, shard_size=2),  # groups [0, 2] and [1, 3]
        dynamic=catalog,
        interval=manager.config.interval,
        on_candidate=cands.append,
    )


def _dynamic_job(rank: int, world: int, tmp: str) -> dict:
    t = Trainer("moe", rank=rank, world=world, ddp=False)
    manager = _manager(tmp, "moe-cert", world)
    candidates: list[int] = []
    scout = _moe_scout(t, manager, world, candidates)
    # The dynamic check at step 30 replays expert 1 (the experts rotate per planned check):
    # rank 3 of group [1, 3] computes it wrong from step 27.
    faults = ComputeFaults(
        [PersistentSDC(rank=3, module=t.model.experts[1], from_step=27)], rank=rank
    )
    faults.arm()
    faults.install(t.opt)
    table, captured = {}, {}
    seen = Verdicts(scout)

    def resolved() -> None:  # pipelined: a boundary's verdict is known at the next hook
        r = seen.collect()
        if r is not None and r.step % manager.config.interval == 0:
            manager.trust.wait()
            table[r.step] = {
                "status": r.status,
                "cycle": r.complete_cycle,
                "candidate": scout.certifier.candidate,
                "verified": manager.find_latest(RecoveryMode.RECOVERY_VERIFIED),
            }

    for step in range(1, 31):
        manager.maybe_wait()
        resolved()
        t.step()
        if step % manager.config.interval != 0:
            scout.maybe_check(step)
        elif scout.before_capture(step):
            manager.save(t.state(step), step)
            captured[step] = digest(t.state(step))
            seen.held.append(step)
            scout.after_capture(step)
    manager.wait_persisted(timeout_s=60)  # resolves step 30's verdict
    resolved()
    status = manager.store().sidecar.status()
    out = {
        "table": table,
        "captured": {s: captured[s] for s in seen.captured()},
        "held": seen.held,
        "candidates": candidates,
        "rejected": status.rejected,
        "sidecar_verified": status.verified_history,
        "verdict": status.verdict,
        "groups": scout.last_result.groups,
        "reason": scout.last_result.reason,
    }
    scout.close()
    manager.close(finished=False)  # the job stops after the SDC; a restart resumes it
    return out


def _restarted_job(rank: int, world: int, tmp: str) -> dict:
    t = Trainer("moe", rank=rank, world=world, ddp=False, seed=99)  # fresh weights
    manager = _manager(tmp, "moe-cert", world)
    scout = _moe_scout(t, manager, world, [])
    latest = manager.find_latest()
    decision = decide_recovery(manager, scout=scout, env={})  # nobody says what happened
    state = manager.load(decision.step, mode=decision.mode)
    out = {"decision": decision, "digest": digest(state), "latest": latest}
    scout.close()
    manager.close()
    return out


def test_dynamic_catalog_certification_is_job_wide_and_a_restart_recovers_verified(
    tmp_path: Path,
) -> None:
    job = run_distributed(_dynamic_job, 4, args=(str(tmp_path),), timeout_s=200)
    h = ScoutStatus.HEALTHY
    expected = {  # step: (status, cycle complete, candidate, verified)
        5: (h, False, None, None),
        10: (h, True, 10, None),  # first complete accepted cycle: 10 is the candidate
        15: (h, False, 10, None),
        20: (h, True, 20, 10),  # second cycle: 10 verified, 20 the next candidate
        25: (h, False, 20, 10),
        30: (ScoutStatus.INCONCLUSIVE, False, None, 10),  # SDC in group [1, 3]: rejected
    }
    for rank, o in enumerate(job):
        got = {
            s: (accepted(v["status"]), v["cycle"], v["candidate"], v["verified"])
            for s, v in o["table"].items()
        }
        assert got == expected, f"rank {rank}"
        # Every rank, also those of the clean group [0, 2], rejects and skips step 30.
        assert sorted(o["captured"]) == [5, 10, 15, 20, 25]
        assert o["held"] == [5, 10, 15, 20, 25, 30]  # 30 launched, held, then discarded
        assert o["candidates"] == [10, 20]
        assert [s for s, _ in o["rejected"]] == [20]
        assert o["sidecar_verified"] == (10,)
        assert o["verdict"] is not None and o["verdict"].step == 30
        # Reports travel inside the comparison group: a rank describes its own group.
        (line,) = o["groups"]
        if rank in (0, 2):
            assert line.startswith("[0, 2]") and "dyn=clean" in line, line
            assert "inconclusive comparison in comparison group [1, 3]" in o["reason"], o
        else:
            assert line.startswith("[1, 3]") and "dyn=inconclusive" in line, line

    again = run_distributed(_restarted_job, 4, args=(str(tmp_path),), timeout_s=200)
    for rank, o in enumerate(again):
        d = o["decision"]
        assert (d.failure_kind, d.mode, d.step) == (
            FailureKind.SDC,
            RecoveryMode.RECOVERY_VERIFIED,
            10,
        )
        assert d.source == "persisted verdict" and "SCOUT verdict" in d.reason
        assert o["latest"] == 25  # re-attached memory: the newest capture, never certified
        assert o["digest"] == job[rank]["captured"][10], f"rank {rank}: not bit-identical"


def _decisions(rank: int, world: int, tmp: str) -> dict:
    t = Trainer("mlp", rank=rank, world=world, ddp=False)
    manager = _manager(tmp, "decisions", world)
    # Checks every step: the MLP's three layers are three recipes, so step 10 is verified
    # once each was checked clean at or after it (steps 10, 11, 12).
    scout = Scout(ScoutConfig(interval=1), t.net, manager=manager.trust, interval=INTERVAL)
    for step in range(1, 13):
        manager.maybe_wait()
        t.step()
        if step % INTERVAL == 0:
            if scout.before_capture(step):
                manager.save(t.state(step), step)
                scout.after_capture(step)
        else:
            scout.maybe_check(step)
    manager.maybe_wait()
    t.step()
    manager.save(t.state(13), 13)  # a capture SCOUT never checked (latest, not verified)
    manager.maybe_wait()

    def decide(**kw: object) -> tuple:
        d = decide_recovery(manager, **kw)
        return d.failure_kind, d.mode, d.step, d.source

    out = {
        "straggler": decide(failure_kind="straggler", env={}),
        "inaccessible": decide(failure_kind=FailureKind.INACCESSIBLE, env={}),
        "env_sdc": decide(env={FAILURE_KIND_ENV: "sdc"}),
        "unknown_no_scout": decide(env={}),
    }
    hang = decide_recovery(manager, failure_kind="hang", scout=scout, env={})
    out["hang_clean"] = (hang.failure_kind, hang.mode, hang.step, hang.source)
    out["hang_clean_sweep"] = (hang.sweep.status, hang.sweep.complete_cycle)
    # Now rank 1 computes block 1 wrong; a hang is declared: the sweep finds it.
    faults = ComputeFaults(
        [PersistentSDC(rank=1, module=scout.blocks[1].module, from_step=0)], rank=rank
    )
    faults.arm()
    faults.install(t.opt)
    sick = decide_recovery(manager, failure_kind="hang", scout=scout, env={})
    out["hang_sdc"] = (sick.failure_kind, sick.mode, sick.step, sick.source)
    out["hang_sdc_sweep"] = (sick.sweep.status, sick.sweep.faulty_ranks, sick.sweep.complete_cycle)
    manager.trust.wait()
    out["after"] = decide(failure_kind="straggler", env={})  # the sweep's verdict persisted
    scout.close()
    manager.close()
    return out


def test_recovery_decision_table_for_every_failure_kind(tmp_path: Path) -> None:
    out = run_distributed(_decisions, 3, args=(str(tmp_path),), timeout_s=150)
    latest, verified = RecoveryMode.LATEST, RecoveryMode.RECOVERY_VERIFIED
    for o in out:
        assert o["straggler"] == (FailureKind.STRAGGLER, latest, 13, "argument")
        assert o["inaccessible"] == (FailureKind.INACCESSIBLE, verified, 10, "argument")
        assert o["env_sdc"] == (FailureKind.SDC, verified, 10, "environment")
        assert o["unknown_no_scout"] == (FailureKind.UNKNOWN, verified, 10, "default")
        assert o["hang_clean"] == (FailureKind.HANG, latest, 13, "argument")
        status, complete = o["hang_clean_sweep"]
        assert (accepted(status), complete) == (ScoutStatus.HEALTHY, True)
        assert o["hang_sdc"] == (FailureKind.HANG, verified, 10, "argument")
        assert o["hang_sdc_sweep"] == (ScoutStatus.SDC, (1,), False)
        assert o["after"] == (FailureKind.SDC, verified, 10, "persisted verdict")

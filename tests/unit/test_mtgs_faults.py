"""Fault schedules, and the injector's opt-in guard, dry-run mode and each fault kind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import (
    ARM_ENV,
    Fault,
    FaultInjector,
    FaultKind,
    FaultSchedule,
    InjectedFaultError,
)
from lm_resiliency.frontdoor.live import _scripted
from lm_resiliency.telemetry import EventLog


def test_parse_round_trips_and_marks_persistent_faults() -> None:
    s = FaultSchedule.parse(" nan_grad@1:3, optimizer_exception@0:5* ,sigkill@2:7")
    assert s.faults == (
        Fault(FaultKind.NAN_GRAD, 1, 3),
        Fault(FaultKind.OPTIMIZER_EXCEPTION, 0, 5, persistent=True),
        Fault(FaultKind.SIGKILL, 2, 7),
    )
    assert FaultSchedule.parse(s.spec()) == s
    assert len(FaultSchedule.parse("")) == 0
    assert len(FaultSchedule.parse(None)) == 0


def test_every_member_sees_the_scripted_joins_of_other_replicas() -> None:
    """A member waits after S - 1 for ``join@R:S`` of another replica R, so its injector (its
    own items only) must still show the job's joins: without this the members raced on and
    the heal landed at a later step, or failed (seen in CI)."""
    member = FaultInjector("leave@1:4,join@1:10,nan_grad@2:3", rank=0)
    assert len(member.schedule) == 0
    assert _scripted(member, FaultKind.JOIN) == {1: frozenset({10})}
    assert _scripted(member, FaultKind.LEAVE) == {1: frozenset({4})}
    assert _scripted(None, FaultKind.JOIN) == {}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("nan_grad@1", "bad fault 'nan_grad@1': expected KIND@RANK:STEP"),
        ("nan_grad@-1:2", "bad fault 'nan_grad@-1:2'"),
        ("bogus@1:2", "unknown fault kind 'bogus' in 'bogus@1:2'; kinds: nan_grad"),
        ("nan_grad@1:0", "step=0 >= 1"),
    ],
)
def test_parse_rejects_bad_items_with_the_syntax(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        FaultSchedule.parse(text)
    assert fragment in str(info.value)


def test_leave_and_join_parse_round_trip_and_script_the_members() -> None:
    s = FaultSchedule.parse("leave@1:23, join@1:30 ,sigkill@2:5,join@2:9,leave@3:9")
    assert s.faults[:2] == (Fault(FaultKind.LEAVE, 1, 23), Fault(FaultKind.JOIN, 1, 30))
    assert FaultSchedule.parse(s.spec()) == s
    assert s.spec() == "leave@1:23,join@1:30,sigkill@2:5,join@2:9,leave@3:9"
    assert FaultKind.LEAVE.scripts_membership and not FaultKind.SIGKILL.scripts_membership
    # leave@R:S: S is the first step without R; join@R:S: S is the first step with R again.
    assert [s.members_at(step, 4) for step in (1, 8, 9, 22, 23, 29, 30)] == [
        (0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2), (0, 1, 2), (0, 2), (0, 2), (0, 1, 2),
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="names replica 3 but the job has 3 replica groups"):
        s.members_at(10, 3)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("leave@1:3*", "leave@1:3* cannot be persistent: a replica leaves or joins once"),
        (
            "join@1:5",
            "join@1:5: replica 1 is a member at step 5, so it cannot join; script its "
            "departure first, e.g. 'leave@1:4,join@1:5'",
        ),
        ("leave@1:5,join@1:5", "join@1:5 must be at a step after leave@1:5"),
        ("leave@2:5,join@2:4", "join@2:4: replica 2 is a member at step 4, so it cannot join"),
        (
            "leave@1:3,leave@1:6",
            "leave@1:6: replica 1 already left at leave@1:3; script 'join@1:S' between them",
        ),
        ("leave@1:3,join@1:6,join@1:8", "join@1:8: replica 1 is a member at step 8"),
        ("leave@x:3", "bad fault 'leave@x:3': expected KIND@RANK:STEP"),
    ],
)
def test_bad_membership_scripts_are_refused_with_the_fix(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        FaultSchedule.parse(text)
    assert fragment in str(info.value)


def test_live_kill_points_fire_by_name_or_for_one_step() -> None:
    from lm_resiliency._killpoints import KILL_ENV, LIVE_KILL_POINTS

    assert len(set(LIVE_KILL_POINTS)) == 7 and "live.bucket_allreduce" in LIVE_KILL_POINTS
    code = (
        "from lm_resiliency._killpoints import kill_point\n"
        "for s in (1, 2, 3):\n"
        "    print('step', s, flush=True)\n"
        "    kill_point('live.vote', step=s)\n"
    )
    for target, steps, rc in (("live.vote@2", 2, -9), ("live.vote", 1, -9), ("live.vote@9", 3, 0)):
        run = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            env={**os.environ, KILL_ENV: target},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (run.returncode, run.stdout.split()[1::2][-1]) == (rc, str(steps)), target


def test_one_shot_faults_hit_the_first_attempt_only_persistent_every_attempt() -> None:
    once, always = Fault(FaultKind.NAN_GRAD, 1, 3), Fault(FaultKind.NAN_GRAD, 1, 3, persistent=True)
    assert [once.hits(1, 3, a) for a in range(3)] == [True, False, False]
    assert [always.hits(1, 3, a) for a in range(3)] == [True, True, True]
    assert not once.hits(0, 3, 0) and not once.hits(1, 4, 0)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_unarmed_process_refuses_to_install_a_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARM_ENV, raising=False)
    model, opt = _model()
    injector = FaultInjector("sigkill@0:1", rank=0)
    assert not injector.armed
    with pytest.raises(ConfigError) as info:
        injector.install(model, opt)
    assert "refusing to inject faults (sigkill@0:1)" in str(info.value)
    assert f"{ARM_ENV}=1" in str(info.value)
    FaultInjector("", rank=0).install(model, opt)  # an empty schedule needs no opt-in


def test_environment_or_arm_call_opts_in(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model()
    monkeypatch.setenv(ARM_ENV, "1")
    assert FaultInjector("nan_grad@0:1", rank=0).armed
    monkeypatch.delenv(ARM_ENV)
    injector = FaultInjector("nan_grad@0:1", rank=0)
    injector.arm()
    injector.install(model, opt)
    assert injector.armed


def test_dry_run_logs_but_does_not_act(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARM_ENV, raising=False)
    model, opt = _model()
    log = EventLog(rank=0)
    injector = FaultInjector("forward_exception@0:1,sigkill@0:1", rank=0, dry_run=True, events=log)
    injector.install(model, opt)
    injector.at_attempt(1, 0)
    out = model(torch.ones(2, 4))  # would raise if armed
    out.sum().backward()  # would SIGKILL this test process if armed
    assert [f.fault.kind for f in injector.fired] == [
        FaultKind.FORWARD_EXCEPTION,
        FaultKind.SIGKILL,
    ]
    assert all(f.dry_run for f in injector.fired)
    assert [r["event"] for r in log.records] == ["fault.dry_run", "fault.dry_run"]
    assert log.records[0]["kind"] == "forward_exception" and log.records[0]["step"] == 1


def _armed(spec: str, rank: int = 0) -> tuple[FaultInjector, nn.Module, torch.optim.Optimizer]:
    model, opt = _model()
    injector = FaultInjector(spec, rank=rank)
    injector.arm()
    injector.install(model, opt)
    return injector, model, opt


def test_forward_and_data_exceptions_and_oom_raise_where_scheduled() -> None:
    injector, model, _ = _armed("data_exception@0:1,forward_exception@0:2,oom@0:3")
    with pytest.raises(InjectedFaultError, match="injected data_exception on rank 0 at step 1"):
        injector.at_attempt(1, 0)
    injector.at_attempt(1, 1)  # one-shot: the retry is clean
    model(torch.ones(1, 4))
    injector.at_attempt(2, 0)
    with pytest.raises(InjectedFaultError, match="forward_exception on rank 0 at step 2 attempt 0"):
        model(torch.ones(1, 4))
    injector.at_attempt(3, 0)
    with pytest.raises(torch.OutOfMemoryError, match="injected oom"):
        model(torch.ones(1, 4))


def test_nan_grad_poisons_the_first_parameter_gradient_only() -> None:
    injector, model, _ = _armed("nan_grad@0:2")
    injector.at_attempt(2, 0)
    model(torch.ones(2, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert grads[0] is not None and torch.isnan(grads[0]).all()
    assert all(g is not None and torch.isfinite(g).all() for g in grads[1:])


def test_optimizer_exception_raises_after_a_partial_corrupt_update() -> None:
    injector, model, opt = _armed("optimizer_exception@0:1")
    before = [p.detach().clone() for p in model.parameters()]
    injector.at_attempt(1, 0)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(InjectedFaultError, match="optimizer_exception after a partial update"):
        opt.step()
    params = list(model.parameters())
    half = len(params) // 2
    assert not torch.equal(params[0], before[0])  # the real update happened
    assert all(torch.isnan(p).all() for p in params[half:])  # then half was overwritten


def test_forced_abort_and_other_ranks_faults() -> None:
    injector, _, _ = _armed("forced_abort@0:4,forced_abort@1:2")
    injector.at_attempt(2, 0)
    assert not injector.forced_abort()  # rank 1's fault
    injector.at_attempt(4, 0)
    assert injector.forced_abort()
    injector.at_attempt(4, 1)
    assert not injector.forced_abort()

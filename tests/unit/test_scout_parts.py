"""SCOUT's parts without a process group: config, groups, digests, replay isolation,
verdicts, stragglers, certification rules, the decision table, the compute faults."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from lm_resiliency.detection import (
    ComparisonGroups,
    DynamicCatalog,
    FailureKind,
    RecipeClass,
    ScoutConfig,
    ScoutResult,
    ScoutStatus,
    decide_mode,
)
from lm_resiliency.detection.certify import Certifier
from lm_resiliency.detection.digest import device_digest_for_test, digest_tensors
from lm_resiliency.detection.replay import replay
from lm_resiliency.detection.signature import Recorder, decode, encode
from lm_resiliency.detection.verdict import Outcome, StragglerRule, judge, straggler_suspects
from lm_resiliency.detection.wire import REPORT_BYTES, ClassReport, RankReport, RunState
from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import BitFlip, ComputeFaults, flip_bit
from lm_resiliency.persistence import RecoveryVerdict, TrustStatus
from lm_resiliency.recovery.mode import RecoveryMode

# -- config and groups ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "ScoutConfig.interval=0 is invalid"),
        ({"interval": True}, "ScoutConfig.interval=True must be an int"),
        ({"enable": 1}, "ScoutConfig.enable=1 must be True or False"),
        ({"dense": {"interval": 3}}, "ScoutConfig.dense={'interval': 3} must be a RecipeClass"),
        ({"straggler_floor_s": float("nan")}, "straggler_floor_s=nan must be a finite number"),
        ({"straggler_min_slowdown": 0.5}, "straggler_min_slowdown=0.5 is invalid"),
        ({"timeout_s": 0}, "ScoutConfig.timeout_s=0 is invalid"),
        (
            {"dense": RecipeClass(enabled=False), "optimizer": RecipeClass(enabled=False)},
            "dense and optimizer recipes are both disabled",
        ),
    ],
)
def test_config_errors_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ScoutConfig(**kwargs)


def test_class_intervals_default_to_geminis_and_can_be_overridden_or_disabled() -> None:
    cfg = ScoutConfig(optimizer=RecipeClass(interval=3), dynamic=RecipeClass(enabled=False))
    assert cfg.class_interval("dense", 10) == 10
    assert cfg.class_interval("optimizer", 10) == 3
    assert cfg.class_interval("dynamic", 10) is None
    assert ScoutConfig(interval=4).class_interval("dense", 10) == 4
    with pytest.raises(ConfigError, match=r"RecipeClass.interval=0 is invalid"):
        RecipeClass(interval=0)


def test_comparison_groups_from_layouts() -> None:
    assert ComparisonGroups.ddp(3).groups == ((0, 1, 2),)
    assert ComparisonGroups.hsdp(8, shard_size=4).groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    mesh = type("Mesh", (), {"mesh": torch.arange(6).reshape(3, 2), "mesh_dim_names": ("r", "s")})
    assert ComparisonGroups.from_mesh(mesh, replicate_dim="r").groups == ((0, 2, 4), (1, 3, 5))
    g = ComparisonGroups.from_ranks([[3, 1], [2, 0]], world_size=4)
    assert g.groups == ((0, 2), (1, 3)) and g.source_of(3) == 1
    with pytest.raises(ConfigError, match="has 1 rank; SCOUT needs at least two replicas"):
        ComparisonGroups.ddp(1)
    with pytest.raises(ConfigError, match=r"rank 1 is in comparison groups 0 and 1"):
        ComparisonGroups.from_ranks([[0, 1], [1, 2]], world_size=3)
    with pytest.raises(ConfigError, match=r"ranks \[3\] are in no comparison group"):
        ComparisonGroups.from_ranks([[0, 1, 2]], world_size=4)
    with pytest.raises(ConfigError, match="shard_size=3 does not divide world_size=8"):
        ComparisonGroups.hsdp(8, shard_size=3)


# -- digests ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize("path", ["cpu", "device"])
def test_any_single_bit_flip_changes_the_digest(dtype: torch.dtype, path: str) -> None:
    """Every bit of every element, one at a time (the CPU digest's CRC-32C half guarantees it)."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(11, 3, generator=g) * 10).to(dtype)

    def d(x: torch.Tensor) -> int:
        return digest_tensors([x]) if path == "cpu" else device_digest_for_test(x)

    base = d(t)
    assert d(t.clone()) == base
    bits = t.element_size() * 8
    seen = {base}
    for index in range(t.numel()):
        for bit in range(bits):
            flipped = t.clone()
            flip_bit(flipped, index, bit)
            value = d(flipped)
            assert value != base, (index, bit)
            seen.add(value)
    assert len(seen) == 1 + t.numel() * bits  # and no two flips collide with each other


@pytest.mark.parametrize("numel", [3, 61, 4099, 300_007])
def test_single_bit_flips_in_long_tensors_change_the_digest(numel: int) -> None:
    """Lengths around the hashes' internal block sizes; flips at the ends and in between."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    base = digest_tensors([t])
    for index in sorted({0, 1, numel // 3, numel // 2, numel - 2, numel - 1}):
        for bit in (0, 1, 13, 22, 23, 30, 31):
            flipped = t.clone()
            flip_bit(flipped, index, bit)
            assert digest_tensors([flipped]) != base, (index, bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_swapping_two_elements_changes_the_digest(dtype: torch.dtype) -> None:
    """Every pair of distinct elements of a small tensor, and far-apart pairs of a long one."""
    small = (torch.randn(24, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    base = digest_tensors([small])
    for i in range(small.numel()):
        for j in range(i + 1, small.numel()):
            if torch.equal(small[i], small[j]):
                continue
            swapped = small.clone()
            swapped[i], swapped[j] = small[j], small[i]
            assert digest_tensors([swapped]) != base, (i, j)
    long = (torch.randn(200_003, generator=torch.Generator().manual_seed(2)) * 100).to(dtype)
    base = digest_tensors([long])
    for i, j in [(0, 1), (0, 199_999), (64, 128), (1000, 1008), (100_000, 200_002)]:
        swapped = long.clone()
        swapped[i], swapped[j] = long[j], long[i]
        assert digest_tensors([swapped]) != base, (i, j)


def test_digest_covers_shape_order_and_missing_gradients() -> None:
    a, b = torch.ones(4), torch.zeros(4)
    assert digest_tensors([a, b]) != digest_tensors([b, a])
    assert digest_tensors([a]) != digest_tensors([a.reshape(2, 2)])
    assert digest_tensors([a, None]) != digest_tensors([a])
    t = torch.arange(12.0).reshape(3, 4)
    assert digest_tensors([t.t()]) == digest_tensors([t.t().contiguous()])  # logical order
    assert digest_tensors([t.t()]) != digest_tensors([t.reshape(4, 3)])
    assert digest_tensors([torch.tensor(3.0)]) != digest_tensors([torch.tensor(4.0)])


# -- replay isolation -------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.drop(self.bn(self.fc(x))) * scale


def _recorded(net: nn.Module, *args: object, **kwargs: object) -> object:
    rec = Recorder([net], count_distinct=False)
    net(*args, **kwargs)
    rec.remove()
    sig = rec.signature(0)
    assert sig is not None
    return decode(json.loads(json.dumps(encode(sig))))  # what a peer receives


def test_replay_is_deterministic_and_leaves_the_training_state_untouched() -> None:
    torch.manual_seed(0)
    net = _Net()
    sig = _recorded(net, torch.randn(8, 6), scale=2.0)
    for p in net.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    torch.use_deterministic_algorithms(False)
    calls: list[int] = []
    hook = net.register_forward_hook(lambda *_: calls.append(1))
    first = replay(net, sig, seed=5)  # type: ignore[arg-type]
    second = replay(net, sig, seed=5)  # type: ignore[arg-type]
    hook.remove()
    assert first.error is None and first.digest == second.digest
    assert replay(net, sig, seed=6).digest != first.digest  # type: ignore[arg-type]
    assert calls == [1, 1]  # through the normal call path: the module's hooks ran
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.are_deterministic_algorithms_enabled()
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats, counter
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in net.parameters())
    assert net.training


def test_replay_of_a_failing_module_reports_the_error_without_raising() -> None:
    net = nn.Linear(4, 4)
    sig = _recorded(net, torch.randn(2, 4))
    broken = nn.Linear(5, 4)
    out = replay(broken, sig, seed=0)  # type: ignore[arg-type]
    assert out.error is not None and "RuntimeError" in out.error


def test_integer_inputs_travel_as_their_value_range_and_floats_as_shapes() -> None:
    emb = nn.Embedding(10, 3)
    sig = _recorded(emb, torch.tensor([[1, 2, 9]]))
    (arg,) = sig.args  # type: ignore[attr-defined]
    assert (arg.shape, arg.dtype, arg.int_range) == ((1, 3), torch.int64, (1, 10))
    assert replay(emb, sig, seed=1).error is None  # type: ignore[arg-type]
    (neg,) = _recorded(nn.Identity(), torch.tensor([-100, -5])).args  # type: ignore[attr-defined]
    assert neg.int_range is None  # nothing non-negative to imitate: zeros
    (farg,) = _recorded(nn.Linear(3, 3), torch.randn(2, 3)).args  # type: ignore[attr-defined]
    assert farg.int_range is None and farg.shape == (2, 3) and farg.floating


def test_discovered_dynamic_catalog_ranks_the_most_frequent_shapes() -> None:
    experts = [nn.Linear(4, 4) for _ in range(2)]
    rec = Recorder(experts, count_distinct=True)
    for n in (3, 5, 3, 3, 5, 7):
        experts[n % 2](torch.randn(n, 4))
    recipes = DynamicCatalog(experts, max_recipes=2).snapshot(rec)
    assert [r.args[0].shape for r in recipes] == [(3, 4), (5, 4)]  # type: ignore[union-attr]
    given = DynamicCatalog(experts, shapes=[[(8, 4)]]).snapshot(None)
    assert [r.args[0].shape for r in given] == [(8, 4)]  # type: ignore[union-attr]


# -- verdicts and stragglers ------------------------------------------------------------


def _ok(d: int, s: float = 0.01) -> ClassReport:
    return ClassReport(RunState.OK, 0, 0, 1, d, s)


def test_majority_names_the_faulty_rank_and_two_peers_are_inconclusive() -> None:
    assert judge({0: _ok(5), 1: _ok(5), 2: _ok(5)}).outcome is Outcome.CLEAN
    v = judge({0: _ok(5), 1: _ok(6), 2: _ok(5), 3: _ok(5)})
    assert (v.outcome, v.faulty) == (Outcome.SDC, (1,))
    assert judge({0: _ok(5), 1: _ok(6)}).outcome is Outcome.INCONCLUSIVE
    assert judge({0: _ok(5), 1: _ok(6), 2: _ok(7)}).outcome is Outcome.INCONCLUSIVE
    assert judge({0: _ok(5), 1: _ok(5), 2: _ok(6), 3: _ok(6)}).outcome is Outcome.INCONCLUSIVE
    err = ClassReport(RunState.ERROR, 0)
    assert judge({0: err, 1: err}).outcome is Outcome.NO_EVIDENCE
    assert judge({0: _ok(5), 1: err, 2: _ok(5)}).faulty == (1,)
    skipped = ClassReport(RunState.NO_SIGNATURE)
    assert judge({0: skipped, 1: skipped}).outcome is Outcome.NO_EVIDENCE


def test_confirmation_rerun_tells_nondeterminism_from_sdc() -> None:
    first = {0: _ok(5), 1: _ok(6), 2: _ok(5)}
    same = judge(first, {0: _ok(5), 1: _ok(6), 2: _ok(5)})
    assert (same.outcome, same.faulty) == (Outcome.SDC, (1,))
    flaky_one = judge(first, {0: _ok(5), 1: _ok(8), 2: _ok(5)})
    assert (flaky_one.outcome, flaky_one.faulty) == (Outcome.SDC, (1,))
    everywhere = judge(first, {0: _ok(9), 1: _ok(8), 2: _ok(7)})
    assert everywhere.outcome is Outcome.NONDETERMINISTIC


def test_stragglers_need_a_robust_margin_an_absolute_floor_and_a_factor() -> None:
    rule = StragglerRule(mad_factor=5.0, floor_s=0.005, min_slowdown=2.0)
    assert straggler_suspects({0: 0.010, 1: 0.011, 2: 0.080}, rule) == {
        2: pytest.approx(7.62, 0.01)
    }
    assert straggler_suspects({0: 0.0010, 1: 0.0011, 2: 0.0040}, rule) == {}  # under the floor
    assert straggler_suspects({0: 0.10, 1: 0.11, 2: 0.15}, rule) == {}  # under 2x
    assert straggler_suspects({0: 0.01, 1: 0.05}, rule) == {1: pytest.approx(5.0)}


def test_report_round_trips_through_its_fixed_wire_form() -> None:
    c = ClassReport(RunState.OK, 3, 2, (1 << 64) - 1, 1 << 63, 0.25)
    r = RankReport(7, 40, 123, True, (c, ClassReport(), ClassReport(RunState.ERROR, 1)))
    raw = r.pack()
    assert len(raw) == REPORT_BYTES == 144 and RankReport.unpack(raw) == r


# -- certification ------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.verdict: RecoveryVerdict | None = None

    def certify(self, step: int, trust: TrustStatus, *, persist: bool = True) -> None:
        self.calls.append(("certify", step, trust.value, persist))

    def reject(self, step: int, *, reason: str) -> None:
        self.calls.append(("reject", step))

    def require_verified_recovery(self, step: int, *, reason: str) -> None:
        self.calls.append(("verdict", step))

    def clear_recovery_verdict(self) -> None:
        self.calls.append(("clear",))

    def recovery_verdict(self) -> RecoveryVerdict | None:
        return self.verdict


def test_dense_certification_is_immediate_and_sdc_latches_until_verified_recovery() -> None:
    sink = _Sink()
    c = Certifier(sink, dynamic=False, persist=True)
    assert c.captured(10) is TrustStatus.RECOVERY_VERIFIED
    c.observe(20, corrupt=True, reason="x", cycle_complete=False)
    assert c.latched is not None and c.captured(30) is TrustStatus.UNVERIFIED
    c.recovered(10, verified=True)
    assert c.latched is None
    assert c.captured(40) is TrustStatus.RECOVERY_VERIFIED
    assert sink.calls == [
        ("certify", 10, "recovery_verified", True),
        ("verdict", 20),
        ("clear",),
        ("certify", 40, "recovery_verified", True),
    ]


def test_dense_k_recipes_stay_candidates_until_every_recipe_is_checked_clean_again() -> None:
    sink = _Sink()
    c = Certifier(sink, dynamic=False, persist=True)
    assert c.captured(5, frontier=-math.inf) is TrustStatus.CANDIDATE
    assert c.captured(10, frontier=-math.inf) is TrustStatus.CANDIDATE
    c.observe(15, corrupt=False, reason="", cycle_complete=False, frontier=5)
    assert (c.pending, c.verified) == ([10], 5)
    assert c.captured(15, frontier=5) is TrustStatus.CANDIDATE
    c.observe(20, corrupt=False, reason="", cycle_complete=False, frontier=12)
    assert (c.pending, c.verified) == ([15], 10)
    assert c.captured(20, frontier=12) is TrustStatus.CANDIDATE
    c.observe(25, corrupt=True, reason="sdc", cycle_complete=False, frontier=12)
    assert c.rejected == [(15, "sdc"), (20, "sdc")] and c.pending == [] and c.verified == 10
    assert sink.calls == [
        ("certify", 5, "candidate", True),
        ("certify", 10, "candidate", True),
        ("certify", 5, "recovery_verified", False),
        ("certify", 15, "candidate", True),
        ("certify", 10, "recovery_verified", False),
        ("certify", 20, "candidate", True),
        ("reject", 15),
        ("reject", 20),
        ("verdict", 25),
    ]


def test_dynamic_certification_candidate_then_verified_and_sdc_rejects() -> None:
    sink, durable = _Sink(), []
    c = Certifier(sink, dynamic=True, persist=True, on_candidate=durable.append)
    assert c.captured(5) is TrustStatus.UNVERIFIED  # cycle incomplete
    c.observe(10, corrupt=False, reason="", cycle_complete=True)
    assert c.captured(10) is TrustStatus.CANDIDATE
    c.observe(20, corrupt=False, reason="", cycle_complete=True)
    assert c.captured(20) is TrustStatus.CANDIDATE and c.verified == 10
    c.observe(30, corrupt=True, reason="sdc", cycle_complete=False)
    assert (c.candidate, c.verified) == (None, 10)
    assert durable == [10, 20]
    assert sink.calls == [
        ("certify", 10, "candidate", True),
        ("certify", 10, "recovery_verified", False),
        ("certify", 20, "candidate", True),
        ("reject", 20),
        ("verdict", 30),
    ]


def test_a_durable_writer_hears_each_candidates_fate_once_and_only_for_steps_it_wrote() -> None:
    events: list[tuple[str, int]] = []
    c = Certifier(
        _Sink(),
        dynamic=True,
        persist=True,
        on_candidate=lambda s: events.append(("write", s)),
        on_verified=lambda s: events.append(("verified", s)),
        on_rejected=lambda s: events.append(("rejected", s)),
    )
    c.observe(10, corrupt=False, reason="", cycle_complete=True)
    c.captured(10, frontier=-math.inf)  # the dense recipes do not cover 10 yet
    c.observe(20, corrupt=False, reason="", cycle_complete=True, frontier=-math.inf)
    c.captured(20, frontier=-math.inf)
    assert events == [("write", 10), ("write", 20)]  # 10 waits for the dense coverage
    c.observe(25, corrupt=False, reason="", cycle_complete=False, frontier=12)
    assert events[2:] == [("verified", 10)]
    c.observe(30, corrupt=True, reason="sdc", cycle_complete=False)
    c.observe(35, corrupt=True, reason="sdc", cycle_complete=False)  # latched: told once
    assert events[3:] == [("rejected", 20)]
    c.recovered(10, verified=True)
    c.observe(40, corrupt=False, reason="", cycle_complete=True)
    c.captured(40)
    c.recovered(30, verified=True)  # 40's timeline abandoned: it hears nothing
    c.observe(50, corrupt=True, reason="sdc", cycle_complete=False)
    assert events[4:] == [("write", 40)]


# -- the decision table -------------------------------------------------------------------


def _sweep(status: ScoutStatus, complete: bool) -> ScoutResult:
    return ScoutResult(step=0, status=status, complete_cycle=complete, reason="r")


@pytest.mark.parametrize(
    ("kind", "sweep", "mode"),
    [
        (FailureKind.SDC, None, RecoveryMode.RECOVERY_VERIFIED),
        (FailureKind.INACCESSIBLE, None, RecoveryMode.RECOVERY_VERIFIED),
        (FailureKind.STRAGGLER, None, RecoveryMode.LATEST),
        (FailureKind.HANG, _sweep(ScoutStatus.HEALTHY, True), RecoveryMode.LATEST),
        (FailureKind.UNKNOWN, _sweep(ScoutStatus.STRAGGLER, True), RecoveryMode.LATEST),
        (FailureKind.HANG, _sweep(ScoutStatus.HEALTHY, False), RecoveryMode.RECOVERY_VERIFIED),
        (FailureKind.HANG, _sweep(ScoutStatus.SDC, False), RecoveryMode.RECOVERY_VERIFIED),
        (
            FailureKind.UNKNOWN,
            _sweep(ScoutStatus.INCONCLUSIVE, True),
            RecoveryMode.RECOVERY_VERIFIED,
        ),
        (FailureKind.UNKNOWN, None, RecoveryMode.RECOVERY_VERIFIED),
    ],
)
def test_decision_table(kind: FailureKind, sweep: ScoutResult | None, mode: RecoveryMode) -> None:
    assert decide_mode(kind, sweep)[0] is mode


def test_failure_kind_from_text_names_the_choices() -> None:
    assert FailureKind.parse("hang", where="x") is FailureKind.HANG
    with pytest.raises(ConfigError, match="LM_RESILIENCY_FAILURE_KIND='oom' is not a failure kind"):
        FailureKind.parse("oom", where="LM_RESILIENCY_FAILURE_KIND")


# -- compute faults -------------------------------------------------------------------------


def test_bit_flip_fires_once_after_its_step_and_needs_arming() -> None:
    lin = nn.Linear(3, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    before = lin.weight.detach().clone()
    faults = ComputeFaults([BitFlip(rank=0, param=lin.weight, step=2, index=4, bit=30)], rank=0)
    with pytest.raises(ConfigError, match="LM_RESILIENCY_FAULTS=1"):
        faults.install(opt)
    faults.arm()
    faults.install(opt)
    for _ in range(4):
        opt.step()
    changed = (lin.weight.detach() != before).nonzero().tolist()
    assert changed == [[1, 1]] and faults.fired == [("bit_flip", 2)]


# -- the component without a process group ------------------------------------------------


def test_a_disabled_scout_permits_every_capture_and_an_enabled_one_needs_a_process_group() -> None:
    from lm_resiliency.detection import Scout

    model = nn.Linear(3, 3)
    off = Scout(ScoutConfig(enable=False), model)
    assert off.before_capture(10) and off.check(10).status is ScoutStatus.HEALTHY
    off.after_capture(10)
    assert off.maybe_check(10) is None and off.latched is None
    off.close()
    with pytest.raises(ConfigError, match=r"call torch\.distributed\.init_process_group"):
        Scout(ScoutConfig(), model)
    with pytest.raises(ConfigError, match="interval=0 must be a positive int"):
        Scout(ScoutConfig(enable=False), model, interval=0)


def _check_reports(step: int, block: int, sig: int, digests: list[int]) -> list[RankReport]:
    """Every rank's report of a check that replayed ``block`` (digests per rank)."""
    return [
        RankReport(
            step,
            step,
            1,
            False,
            (
                ClassReport(RunState.OK, block, 0, sig, d, 0.001),
                ClassReport(RunState.OK, block, 0, 0, 7, 0.0),
                ClassReport(),
            ),
        )
        for d in digests
    ]


def _credit(cov: object, step: int, block: int, sig: int, digests: list[int]) -> None:
    from lm_resiliency.detection.assess import assess
    from lm_resiliency.detection.coverage import Coverage

    assert isinstance(cov, Coverage)
    reports = _check_reports(step, block, sig, digests)
    a = assess(reports, cov.groups, StragglerRule(5.0, 0.005, 2.0))
    cov.credit(step, a, reports, {"dense", "optimizer"})


def test_coverage_groups_blocks_by_signature_and_needs_every_recipe_clean_since() -> None:
    from lm_resiliency.detection.blocks import partition
    from lm_resiliency.detection.coverage import Coverage

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    disabled: set[int] = set()
    cov = Coverage(
        partition(model),
        ComparisonGroups.ddp(3),
        classes={"dense", "optimizer", "dynamic"},
        disabled=disabled,
    )
    assert cov.frontier() == -math.inf and cov.recipes() == 3  # nothing seen: 3 unknowns
    _credit(cov, 5, 0, 11, [1, 1, 1])
    _credit(cov, 10, 1, 11, [2, 2, 2])  # the same signature as block 0: one recipe
    assert cov.recipes() == 2 and cov.frontier() == -math.inf  # block 2 never checked
    assert cov.unchecked() == ["2"]
    _credit(cov, 15, 2, 22, [3, 3, 3])
    assert cov.frontier() == 10  # blocks 0 and 1 share the recipe last clean at 10
    _credit(cov, 20, 0, 11, [4, 4, 9])  # a mismatch: no credit
    assert cov.frontier() == 10
    _credit(cov, 25, 0, 11, [5, 5, 5])
    assert cov.frontier() == 15
    disabled.add(1)  # a block that can never be checked: captures stay candidates
    assert cov.frontier() == -math.inf and "1 (disabled: never checked)" in cov.unchecked()
    disabled.clear()
    cov.reset()  # after a recovery nothing is covered, but signatures stay known
    assert cov.frontier() == -math.inf and cov.recipes() == 2


def test_coverage_of_a_single_signature_is_the_checks_own_step() -> None:
    from lm_resiliency.detection.blocks import partition
    from lm_resiliency.detection.coverage import Coverage

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    cov = Coverage(
        partition(model), ComparisonGroups.ddp(2), classes={"dense", "optimizer"}, disabled=set()
    )
    _credit(cov, 5, 0, 11, [1, 1])
    _credit(cov, 10, 1, 11, [1, 1])
    assert cov.frontier() == 10
    _credit(cov, 15, 0, 11, [1, 1])
    assert cov.frontier() == 15  # K = 1: a capture at the check's step is verified at once
    # Neither dense nor optimizer enabled: nothing to cover.
    off = Coverage(partition(model), ComparisonGroups.ddp(2), classes={"dynamic"}, disabled=set())
    assert off.frontier() == math.inf


def test_ddp_groups_of_a_bounded_size_partition_the_world() -> None:
    from lm_resiliency.detection import ComparisonGroups

    assert ComparisonGroups.ddp(4).groups == ((0, 1, 2, 3),)
    assert ComparisonGroups.ddp(8, size=4).groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ComparisonGroups.ddp(9, size=4).groups == ((0, 1, 2, 3), (4, 5, 6, 7, 8))
    assert ComparisonGroups.ddp(11, size=4).groups == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10))
    with pytest.raises(ConfigError, match="size=2 must be an int >= 3"):
        ComparisonGroups.ddp(8, size=2)


def test_ddp_groups_are_bounded_by_default_so_the_exchange_does_not_grow_with_the_job() -> None:
    from lm_resiliency.detection import ComparisonGroups
    from lm_resiliency.detection.groups import DDP_GROUP_SIZE, bounded_replica_groups

    assert DDP_GROUP_SIZE == 8
    assert ComparisonGroups.ddp(8).groups == (tuple(range(8)),)
    assert ComparisonGroups.ddp(10).groups == (tuple(range(10)),)  # a remainder of 2 joins
    assert ComparisonGroups.ddp(16).groups == (tuple(range(8)), tuple(range(8, 16)))
    big = ComparisonGroups.ddp(10_000)
    assert len(big.groups) == 1250 and {len(g) for g in big.groups} == {8}
    assert ComparisonGroups.ddp(16, size=None).groups == (tuple(range(16)),)
    # the DDP adapter's layout: its process group's ranks, in the same bounded groups
    assert bounded_replica_groups((3, 1, 2, 0), 8) == ((0, 1, 2, 3),)

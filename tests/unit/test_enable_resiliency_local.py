"""enable_resiliency in one process (no process group): hooks, captures, state, validation."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lm_resiliency import (
    ConfigError,
    InMemoryCkptConfig,
    MTGSConfig,
    ResiliencyConfig,
    ResiliencyError,
    ScoutConfig,
    StateEncodingError,
    enable_resiliency,
)
from lm_resiliency.frontdoor.objects import StateObjects
from lm_resiliency.frontdoor.schedulers import SchedulerReplay
from lm_resiliency.rng import capture_rng, restore_rng
from lm_resiliency.state import decode_state, encode_state


class Counter:
    """A stateful object, like a data loader's position."""

    def __init__(self, extra: Any = None) -> None:
        self.n = 0
        self.extra = extra

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n}
        if self.extra is not None:
            out["extra"] = self.extra
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_captures_hang_off_the_optimizer_step_every_interval() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=3) as resiliency:
        assert (resiliency.start_step, resiliency.step) == (0, 0)
        assert resiliency.last_recovery.source == "fresh"
        _train(model, [opt], 7)
        assert resiliency.step == 7
        assert resiliency.stats.captures == 2  # steps 3 and 6
        assert len(resiliency.stats.wait_s) == 2  # each waited for before the next step
        assert [s.step for s in resiliency.manager.slots().values()] == [6, 3]
        assert resiliency.interval == 3
    with pytest.raises(ResiliencyError, match="closed"):
        resiliency.add_capture_gate(lambda step: True)
    resiliency.close()  # idempotent


def test_with_two_optimizers_a_step_ends_when_both_stepped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in model]
    with enable_resiliency(model, opts, interval=2) as resiliency:
        _train(model, opts, 4)
        assert resiliency.step == 4
        assert resiliency.stats.captures == 2


def test_a_capture_gate_that_says_no_skips_the_capture() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    with enable_resiliency(model, opt, interval=2) as resiliency:
        resiliency.add_capture_gate(lambda step: seen.append(step) or step != 4)
        _train(model, [opt], 6)
        assert seen == [2, 4, 6]
        assert (resiliency.stats.captures, resiliency.stats.skipped) == (2, 1)
        resiliency.manager.maybe_wait()  # the capture of step 6 is still copying
        assert sorted(s.step for s in resiliency.manager.slots().values()) == [2, 6]


def test_an_unsupported_state_value_fails_at_enable_with_its_key_path() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(StateEncodingError, match=r"rank/state/loader/extra"):
        enable_resiliency(model, opt, state={"loader": Counter(extra=object())})


def test_a_value_that_becomes_unsupported_fails_at_the_first_capture_with_its_key_path() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Counter()
    resiliency = enable_resiliency(model, opt, interval=2, state={"loader": loader})
    _train(model, [opt], 1)
    loader.extra = {"sampler": object()}
    with pytest.raises(StateEncodingError, match=r"rank/state/loader/extra/sampler"):
        _train(model, [opt], 1)
    resiliency.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "interval=0 is invalid"),
        ({"interval": True}, "interval=True is invalid"),
        ({"config": {"interval": 5}}, "config must be an InMemoryCkptConfig, got dict"),
        ({"mtgs": MTGSConfig()}, "needs a DistributedDataParallel model"),
        ({"mtgs": {"max_retries": 1}}, "mtgs must be an MTGSConfig, got dict"),
        ({"scout": object()}, "scout must be a ScoutConfig, got object"),
        ({"state": [Counter()]}, "state must be a dict"),
        ({"state": {"a/b": Counter()}}, "state key 'a/b' is invalid"),
        ({"state": {"rng": 3}}, r"state\['rng'\] \(int\) has no state_dict\(\)"),
    ],
)
def test_invalid_arguments_fail_before_anything_is_built(
    kwargs: dict[str, Any], message: str
) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=message):
        enable_resiliency(model, opt, **kwargs)


def test_interval_overrides_the_config_interval() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(interval=7, disk_folder="elsewhere")
    with enable_resiliency(model, opt, interval=2, config=config) as resiliency:
        assert resiliency.manager.config.interval == 2
        assert str(resiliency.manager.config.disk_folder) == "elsewhere"


def test_a_resiliency_config_is_the_same_call_as_the_separate_arguments() -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gemini = InMemoryCkptConfig(interval=7, disk_folder="elsewhere")
    nested = ResiliencyConfig(gemini=gemini)
    with enable_resiliency(model, opt, interval=2, config=nested) as resiliency:
        assert resiliency.manager.config.interval == 2
        assert str(resiliency.manager.config.disk_folder) == "elsewhere"
        assert resiliency.mtgs is None
    # The nested tiers reach the same checks as mtgs=/scout= (this model has no replicas).
    for tier, message in (
        (ResiliencyConfig(mtgs=MTGSConfig()), "needs a DistributedDataParallel model"),
        (ResiliencyConfig(scout=ScoutConfig()), "compares data-parallel replicas"),
    ):
        with pytest.raises(ConfigError, match=message):
            enable_resiliency(model, opt, config=tier)


@pytest.mark.parametrize(
    ("nested", "kwargs", "message"),
    [
        ({"mtgs": MTGSConfig()}, {"mtgs": MTGSConfig()}, "mtgs is given twice"),
        ({"scout": ScoutConfig()}, {"scout": ScoutConfig()}, "scout is given twice"),
        (
            {"gemini": {"interval": 5}},
            {},
            "ResiliencyConfig.gemini=.* must be an InMemoryCkptConfig",
        ),
    ],
)
def test_a_resiliency_config_refuses_a_tier_given_twice_or_of_the_wrong_type(
    nested: dict[str, Any], kwargs: dict[str, Any], message: str
) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=message):
        enable_resiliency(model, opt, config=ResiliencyConfig(**nested), **kwargs)


def _overrides(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "overrides config.interval" in r.getMessage()]


def test_the_interval_override_warns_only_about_an_interval_the_user_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No config, or a config whose interval is the field default: nothing to override.
    for config in (None, InMemoryCkptConfig(disk_folder="elsewhere")):
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        caplog.clear()
        with enable_resiliency(model, opt, interval=5, config=config) as resiliency:
            assert resiliency.manager.config.interval == 5
        assert _overrides(caplog) == [], config
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caplog.clear()
    with enable_resiliency(model, opt, interval=5, config=InMemoryCkptConfig(interval=7)):
        pass
    assert _overrides(caplog) == [
        "enable_resiliency: interval=5 overrides config.interval=7 (pass interval=7 to keep "
        "the config's cadence)"
    ]


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mtgs": MTGSConfig()}, "needs a DistributedDataParallel model (its vote rides in "
         "DDP's gradient all-reduce), got {name} (adapter 'torch'); wrap the model in DDP"),
        ({"scout": ScoutConfig()}, "compares data-parallel replicas, but the model {name} "
         "(adapter 'torch') has none"),
    ],
)  # fmt: skip
def test_a_refused_combination_names_the_model_type(kwargs: dict[str, Any], message: str) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        enable_resiliency(model, opt, **kwargs)
    assert message.format(name=f"{__name__}.TinyNet") in str(info.value)


def test_train_step_needs_mtgs_and_an_optimizer_is_required() -> None:
    model = nn.Linear(4, 4)
    resiliency = enable_resiliency(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="pass mtgs=MTGSConfig"):
        resiliency.train_step(lambda: model(torch.zeros(1, 4)).sum())
    resiliency.close()
    with pytest.raises(ConfigError, match="no optimizer to hook"):
        enable_resiliency(model)
    with pytest.raises(ConfigError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        enable_resiliency(model, "sgd")
    with pytest.raises(ConfigError, match=r"does not know builtins\.str"):
        enable_resiliency("model")


def test_every_generator_round_trips_through_the_capture_encoding() -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    enc = encode_state(capture_rng())
    state = decode_state(enc.document, [t.clone() for t in enc.tensors])
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    restore_rng(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0])
    assert got[1:] == expected[1:]


def test_a_grad_scaler_is_restored_with_the_update_its_captured_step_was_missing() -> None:
    # The capture runs inside scaler.step(optimizer); scaler.update() comes after.
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=1.7, growth_interval=3)
    objects = StateObjects({"scaler": scaler})
    for _ in range(7):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.step(opt)
        captured = objects.state_dicts()["scaler"]  # what the post-step hook sees
        scaler.update()
        opt.zero_grad()
        restored = torch.amp.GradScaler("cpu")
        StateObjects({"scaler": restored}).load({"scaler": captured})
        assert restored.state_dict() == scaler.state_dict()
    assert scaler.get_scale() != 3.0  # the growth step was exercised


def _bn_model() -> nn.Module:
    # Large weights first: their copy is still running when the next forward starts.
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)), nn.BatchNorm1d(1024))


def test_buffers_the_next_forward_updates_in_place_are_captured_at_their_step() -> None:
    # BatchNorm's running statistics change inside the next forward, before the
    # optimizer step the capture's wait hangs off: the plain loop's capture of step N
    # must still hold step N's statistics (they are copied first, and a forward
    # pre-hook waits for that copy).
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bn = model[4]
    with enable_resiliency(model, opt, interval=1) as resiliency:
        for step in range(1, 9):
            model(torch.randn(4, 1024)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected = (
                bn.running_mean.clone(),
                bn.running_var.clone(),
                int(bn.num_batches_tracked),
            )
            model(torch.randn(4, 1024)).sum().backward()  # the next step's forward/backward
            resiliency.manager.maybe_wait()
            saved = resiliency.manager.load(step)["adapter"]["model"]
            assert torch.equal(saved["4.running_mean"], expected[0]), step
            assert torch.equal(saved["4.running_var"], expected[1]), step
            assert int(saved["4.num_batches_tracked"]) == expected[2], step
            opt.zero_grad()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write: a read-only tmpfs mount as root (who ignores
    permission bits), mode 0555 otherwise."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)]
    if subprocess.run(mount, check=False, capture_output=True).returncode != 0:
        pytest.skip("root without permission to mount a read-only tmpfs")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("sub", ["", "ckpt"])
def test_an_unwritable_disk_folder_is_refused_at_enable(read_only_dir: Path, sub: str) -> None:
    # The folder itself, or the parent that persisting would create it in: a raw OSError
    # at enable before, or a warning at every flush.
    folder = read_only_dir / sub if sub else read_only_dir
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2)
    with pytest.raises(ConfigError) as info:
        enable_resiliency(model, opt, interval=2, config=config)
    message = str(info.value)
    target = "it" if not sub else f"its parent {read_only_dir}"
    assert f"disk_folder={str(folder)!r}: {target} is " in message
    assert "(disk_flush_interval=2, signal_flush=True)" in message
    assert "use a writable node-local directory, or persist nothing" in message
    if not sub:
        return  # (reading an existing folder's lineage still creates the run folder in it)
    # Persisting nothing: the folder is never created, so it is no reason to refuse.
    quiet = dataclasses.replace(config, disk_flush_interval=0, signal_flush=False)
    with enable_resiliency(model, opt, interval=2, config=quiet) as resiliency:
        _train(model, [opt], 4)
        assert resiliency.manager.find_latest() == 4


def test_a_fallback_that_finds_nothing_reports_a_fresh_start_on_every_rank(
    tmp_path: Path,
) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(disk_folder=tmp_path, run_id="fresh-fallback")
    with enable_resiliency(model, opt, config=config, load_fallback=lambda: None) as handle:
        info = handle.last_recovery
        assert (info.step, info.source, info.sources) == (None, "fresh", ("fresh",))


def _cosine(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)


def test_a_scheduler_captured_inside_the_step_is_replayed_to_its_state_after_it() -> None:
    # What the post-step hook captures, then the loop's scheduler.step(); the restore
    # of that capture (optimizer first, then the scheduler and its replay) must land
    # exactly where the uninterrupted run is after scheduler.step().
    model = nn.Linear(4, 4)
    opt, sched = _cosine(model)
    for _ in range(7):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        captured = ({"sched": sched.state_dict()}, opt.state_dict())
        sched.step()
        opt.zero_grad()
        new_opt, new_sched = _cosine(nn.Linear(4, 4))
        new_opt.load_state_dict(captured[1])
        replay = SchedulerReplay(StateObjects({"sched": new_sched}).items(), active=True)
        StateObjects({"sched": new_sched}).load(captured[0])
        replay.replay(["sched"])
        assert new_sched.state_dict() == sched.state_dict()
        assert new_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # bit for bit
    assert sched.last_epoch == 7


@pytest.mark.parametrize(
    ("every", "message"),
    [(2, "it was stepped 0 times"), (0.5, "it was stepped 2 times")],
    ids=["per-epoch", "twice-per-step"],
)
def test_a_loop_that_steps_its_scheduler_otherwise_is_refused(every: float, message: str) -> None:
    model = nn.Linear(4, 4)
    opt, sched = _cosine(model)
    with enable_resiliency(model, opt, interval=3, state={"sched": sched}) as resiliency:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        for _ in range(1 if every == 2 else 2):
            if every != 2:
                sched.step()
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(
            ConfigError, match=rf"state\['sched'\] \(CosineAnnealingLR\).*{message}"
        ):
            opt.step()
        assert resiliency.step == 1


def test_a_plateau_scheduler_is_refused_at_enable_and_mtgs_replays_nothing() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ConfigError, match=r"state\['plateau'\] is a ReduceLROnPlateau"):
        enable_resiliency(model, opt, interval=3, state={"plateau": plateau})
    assert SchedulerReplay([("plateau", plateau)], active=False).to_replay() == []


def test_a_save_durable_that_is_not_callable_is_refused_naming_it() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"save_durable='ckpt/' must be a callable"):
        enable_resiliency(model, opt, save_durable="ckpt/")  # type: ignore[arg-type]


def test_the_dynamic_catalog_is_given_once() -> None:
    from lm_resiliency.detection import DynamicCatalog, Scout

    experts = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with pytest.raises(ConfigError, match=r"must be a DynamicCatalog or None, e\.g\. catalog="):
        ScoutConfig(catalog=experts)  # type: ignore[arg-type]
    config = ScoutConfig(catalog=DynamicCatalog(experts, shapes=[[(2, 4)]]))
    with pytest.raises(ConfigError, match="two dynamic catalogs"):
        Scout(config, nn.Sequential(*experts), dynamic=DynamicCatalog(experts))

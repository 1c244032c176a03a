"""The front door's checks of ``live=LiveConfig(...)`` (before anything collective)."""

from __future__ import annotations

import logging

import pytest
import torch

from lm_resiliency import ConfigError, LiveConfig, MTGSConfig, ResiliencyConfig, enable_resiliency
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.detection.scout_config import ScoutConfig
from lm_resiliency.frontdoor.live import NO_REPLICA_DIMENSION, check_live, live_gemini_config
from lm_resiliency.frontdoor.validate import split_config

_ENV = {"LMR_LIVE_COORDINATOR": "127.0.0.1:29600", "LMR_REPLICA_GROUPS": "4"}


def test_live_without_mtgs_is_refused_by_enable_resiliency() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"live=LiveConfig\(\.\.\.\) needs mtgs=MTGSConfig"):
        enable_resiliency(model, opt, live=LiveConfig())


def test_live_needs_two_phase_commit_and_shadow() -> None:
    with pytest.raises(ConfigError, match="two_phase_commit=False"):
        check_live(LiveConfig(), MTGSConfig(two_phase_commit=False), None, _ENV)
    with pytest.raises(ConfigError, match="shadow=False"):
        check_live(LiveConfig(), MTGSConfig(shadow=False), None, _ENV)


def test_live_needs_the_launcher() -> None:
    with pytest.raises(ConfigError, match="lm-resiliency launch --replica-groups R"):
        check_live(LiveConfig(), MTGSConfig(), None, {})


def test_live_refuses_other_types_and_scout() -> None:
    with pytest.raises(ConfigError, match=r"LiveConfig, got dict"):
        check_live({"lease_s": 1}, MTGSConfig(), None, _ENV)
    with pytest.raises(ConfigError, match="scout=ScoutConfig"):
        check_live(LiveConfig(), MTGSConfig(), ScoutConfig(), _ENV)


def test_one_replica_group_keeps_todays_path(caplog: pytest.LogCaptureFixture) -> None:
    env = dict(_ENV, LMR_REPLICA_GROUPS="1")
    with caplog.at_level(logging.WARNING):
        assert check_live(LiveConfig(), MTGSConfig(), None, env) is None
    assert NO_REPLICA_DIMENSION in caplog.text
    assert check_live(LiveConfig(), MTGSConfig(), None, _ENV) == LiveConfig()


def test_resiliency_config_carries_live_once() -> None:
    live = LiveConfig(lease_s=1.0)
    nested = ResiliencyConfig(mtgs=MTGSConfig(), live=live)
    assert split_config(nested, None, None, None)[3] is live
    with pytest.raises(ConfigError, match="live is given twice"):
        split_config(nested, None, None, LiveConfig())


def test_gemini_memory_is_namespaced_per_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LM_RESILIENCY_RUN_ID", raising=False)
    monkeypatch.setenv("LMR_LIVE_RUN", "job7")
    assert live_gemini_config(InMemoryCkptConfig(), 2).run_id == "job7.r2"
    assert live_gemini_config(InMemoryCkptConfig(run_id="x"), 0).run_id == "x.r0"

"""LiveConfig validation: invalid values fail at construction, naming the field and a fix."""

from __future__ import annotations

import dataclasses

import pytest

from lm_resiliency.errors import ConfigError
from lm_resiliency.live.config import LiveConfig


def test_defaults_are_the_designed_timings() -> None:
    c = LiveConfig()
    assert (c.heartbeat_s, c.lease_s, c.stale_s, c.poll_slice_s, c.decision_tick_s) == (
        0.1, 0.5, 0.25, 0.05, 0.01,
    )  # fmt: skip
    assert (c.reform_timeout_s, c.coordinator_timeout_s, c.join_timeout_s) == (5, 3, 600)
    assert (c.heal_timeout_s, c.pg_timeout_s, c.min_replicas, c.digest_every) == (30, 30, 1, 0)
    assert (c.max_membership_changes, c.loss_reduction, c.reseed_all) == (None, "mean", False)


def test_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        LiveConfig(0.1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LiveConfig().lease_s = 1.0  # type: ignore[misc]


def test_max_membership_changes_none_means_one_per_replica() -> None:
    assert LiveConfig().changes_per_step(4) == 4
    assert LiveConfig(max_membership_changes=2).changes_per_step(4) == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"heartbeat_s": 0}, "LiveConfig.heartbeat_s=0 is invalid; use a positive number"),
        ({"lease_s": float("nan")}, "LiveConfig.lease_s=nan must be a finite number"),
        ({"poll_slice_s": "0.05"}, "LiveConfig.poll_slice_s='0.05' must be a number"),
        ({"decision_tick_s": -1.0}, "decision_tick_s=-1.0 is invalid"),
        ({"reform_timeout_s": 1e18}, "reform_timeout_s=1e+18 is invalid"),
        ({"lease_s": 0.2}, "lease_s=0.2 must be >= 3 x heartbeat_s=0.1"),
        ({"lease_s": 0.2}, "raise lease_s to 0.3 or lower heartbeat_s to 0.0666667"),
        ({"stale_s": 0.05}, "stale_s=0.05 must lie between heartbeat_s=0.1 and lease_s=0.5"),
        ({"stale_s": 0.6}, "stale_s=0.6 must lie between"),
        ({"min_replicas": 0}, "LiveConfig.min_replicas=0 must be >= 1"),
        ({"min_replicas": True}, "min_replicas=True must be an int"),
        ({"max_membership_changes": 0}, "max_membership_changes=0 must be >= 1, or None"),
        ({"digest_every": -1}, "digest_every=-1 must be >= 0"),
        ({"loss_reduction": "avg"}, "loss_reduction='avg' must be one of 'mean', 'sum'"),
        ({"reseed_all": 1}, "LiveConfig.reseed_all=1 must be True or False"),
    ],
)
def test_invalid_values_name_the_field_the_value_and_a_fix(kwargs, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        LiveConfig(**kwargs)
    assert fragment in str(err.value)


def test_a_lease_of_exactly_three_heartbeats_is_accepted() -> None:
    c = LiveConfig(heartbeat_s=0.2, lease_s=0.6, stale_s=0.3)
    assert c.lease_s == 0.6

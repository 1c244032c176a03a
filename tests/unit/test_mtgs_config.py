"""MTGSConfig validation: invalid values fail at construction, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from lm_resiliency.errors import ConfigError
from lm_resiliency.transactions import ExhaustedPolicy, MTGSConfig


def test_defaults_are_the_safe_full_protocol() -> None:
    c = MTGSConfig()
    assert (c.max_retries, c.vote_in_hook, c.shadow, c.two_phase_commit) == (2, True, True, True)
    assert c.force_abort_steps == frozenset()
    assert c.on_exhausted is ExhaustedPolicy.RAISE


def test_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        MTGSConfig(3)  # type: ignore[misc]
    c = MTGSConfig(max_retries=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_retries = 5  # type: ignore[misc]


def test_force_abort_steps_are_normalised_to_a_frozenset() -> None:
    assert MTGSConfig(force_abort_steps=[2, 3, 2]).force_abort_steps == frozenset({2, 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_retries": -1}, "max_retries=-1 must be >= 0"),
        ({"max_retries": True}, "max_retries=True must be an int"),
        ({"max_retries": 1.5}, "max_retries=1.5 must be an int"),
        (
            {"collective_timeout_s": 0},
            "collective_timeout_s=0 must be a finite number of seconds > 0",
        ),
        ({"collective_timeout_s": float("inf")}, "collective_timeout_s=inf"),
        ({"collective_timeout_s": "5"}, "collective_timeout_s='5' must be a number"),
        ({"shadow": "yes"}, "MTGSConfig.shadow='yes' must be True or False"),
        ({"vote_in_hook": 1}, "MTGSConfig.vote_in_hook=1 must be True or False"),
        ({"force_abort_steps": {0}}, "force_abort_steps contains 0"),
        ({"force_abort_steps": 2}, "force_abort_steps=2 must be a set of step numbers"),
        ({"force_abort_steps": "2"}, "force_abort_steps='2' must be a set"),
        ({"on_exhausted": "skip"}, "on_exhausted='skip' must be an ExhaustedPolicy (RAISE, SKIP)"),
    ],
)
def test_invalid_values_name_the_field_and_the_fix(
    kwargs: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        MTGSConfig(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)

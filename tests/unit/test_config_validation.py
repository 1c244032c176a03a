"""Config fields are type-checked by their annotations, with named-field errors (#12, 9)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Literal

import pytest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency._validate import Rule, positive_time, validate
from lm_resiliency.errors import ConfigError
from lm_resiliency.knobs import MAX_WAIT_S
from lm_resiliency.transactions import MTGSConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"verify_integrity": "no"}, "verify_integrity='no' must be True or False"),
        ({"enable": 1}, "enable=1 must be True or False"),
        ({"interval": 2.5}, "interval=2.5 must be an int, e.g. interval=10"),
        ({"interval": True}, "interval=True must be an int, e.g. interval=10"),
        ({"interval": "10"}, "interval='10' must be an int, e.g. interval=10"),
        ({"keep_generations": 2.0}, "keep_generations=2.0 must be an int"),
        ({"replication_timeout_s": float("nan")}, "replication_timeout_s=nan must be a finite"),
        ({"signal_flush_deadline_s": float("inf")}, "signal_flush_deadline_s=inf must be a finite"),
        ({"replication_timeout_s": -1.0}, "replication_timeout_s=-1.0 is invalid; use a positive"),
        ({"replication_timeout_s": "60"}, "replication_timeout_s='60' must be a number"),
        ({"disk_folder": None}, "disk_folder=None must be a str or a Path"),
        ({"disk_folder": 3}, "disk_folder=3 must be a str or a Path"),
        ({"run_id": 7}, "run_id=7 must be a str or None"),
        ({"copy_rate_limit_bytes_per_s": 2e9}, "copy_rate_limit_bytes_per_s=2000000000.0 must be"),
    ],
)
def test_wrong_types_are_config_errors_naming_field_value_and_choice(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert not isinstance(info.value, TypeError)  # never the raw TypeError of a comparison


def test_valid_values_of_every_accepted_type_pass() -> None:
    cfg = InMemoryCkptConfig(disk_folder=Path("ckpt"), replication_timeout_s=3, run_id="r-1",
                             copy_rate_limit_bytes_per_s=2_000_000_000)  # fmt: skip
    assert cfg.replication_timeout_s == 3 and cfg.disk_folder == Path("ckpt")


@pytest.mark.parametrize("config", [InMemoryCkptConfig, MTGSConfig])
def test_every_field_refuses_a_value_of_the_wrong_type(config: type) -> None:
    # Covers fields added later too: each needs an annotation the validator checks.
    for field in dataclasses.fields(config):
        with pytest.raises(ConfigError) as info:
            config(**{field.name: object()})
        assert f"{field.name}=<object object" in str(info.value), field.name


class _Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Future:
    """Field shapes a config may add; each is checked by one annotation (+ one rule)."""

    memory_folder: str | Path | None = None
    memory_required: bool = False
    control_timeout_s: float = 30.0
    resume: str = "auto"
    mode: _Mode = _Mode.SAFE
    level: Literal["low", "high"] = "low"
    steps: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        validate(self, _FUTURE_RULES, prefix="Future.")


_FUTURE_RULES = {
    "control_timeout_s": positive_time("30"),
    "resume": Rule(
        lambda v: v in ("auto", "finished", "never"),
        "is invalid; use 'auto', 'finished' or 'never'",
    ),
}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_folder": 5}, "Future.memory_folder=5 must be a str, a Path or None"),
        ({"memory_required": "yes"}, "Future.memory_required='yes' must be True or False"),
        ({"control_timeout_s": 0}, "Future.control_timeout_s=0 is invalid; use a positive number"),
        ({"control_timeout_s": True}, "Future.control_timeout_s=True must be a number, e.g. 30"),
        ({"resume": "always"}, "Future.resume='always' is invalid; use 'auto', 'finished' or"),
        ({"mode": "fast"}, "Future.mode='fast' must be a _Mode (FAST, SAFE)"),
        ({"level": "mid"}, "Future.level='mid' must be one of 'low', 'high'"),
        ({"steps": frozenset({1, "2"})}, "must be a frozenset whose items are each an int"),
    ],
)
def test_the_mechanism_checks_new_field_shapes(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _Future(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    ok = _Future(memory_folder=Path("/dev/shm"), control_timeout_s=1, level="high")
    assert ok.level == "high"


# --- issue 20: bad input refused up front ---------------------------------------------


@pytest.mark.parametrize("name", ["control_timeout_s", "replication_timeout_s",
                                  "signal_flush_deadline_s"])  # fmt: skip
def test_a_timeout_too_large_for_any_timer_is_refused_with_the_range(name: str) -> None:
    # 1e18 s passed validation and overflowed timedelta/Gloo at the first collective.
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(**{name: 1e18})  # type: ignore[arg-type]
    assert f"{name}=1e+18 is invalid; use a positive number of seconds up to 2592000" in str(
        info.value
    )
    assert getattr(InMemoryCkptConfig(**{name: MAX_WAIT_S}), name) == MAX_WAIT_S


@pytest.mark.parametrize("name", ["disk_folder", "memory_folder"])
@pytest.mark.parametrize("kind", [str, Path])
def test_a_nul_byte_in_a_folder_is_refused(name: str, kind: type) -> None:
    value = kind("/dev/shm/ck\0pt")
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(**{name: value})
    assert f"{name}={value!r} contains a NUL byte" in str(info.value)


@pytest.mark.parametrize("value", [Path(""), "", "slots", Path("rel/slots"), "./shm"])
def test_a_relative_memory_folder_is_refused(value: str | Path) -> None:
    # Path("") is "." and wrote slots under the working directory.
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(memory_folder=value)
    message = str(info.value)
    assert f"memory_folder={value!r} is not an absolute path" in message
    assert "absolute directory on a memory filesystem (tmpfs)" in message


def test_a_relative_memory_folder_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_RESILIENCY_MEMORY_FOLDER", "shm/slots")
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig()
    message = str(info.value)
    assert "LM_RESILIENCY_MEMORY_FOLDER='shm/slots' is not an absolute path" in message
    assert "absolute directory on a memory filesystem (tmpfs)" in message
    # The variable is only the default: an explicit folder (or None) does not read it.
    assert InMemoryCkptConfig(memory_folder="/dev/shm/x").memory_folder == "/dev/shm/x"
    assert InMemoryCkptConfig(memory_folder=None).memory_folder is None

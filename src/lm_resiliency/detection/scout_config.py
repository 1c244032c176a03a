"""Configuration of SCOUT (replay-based SDC and straggler detection).

Stable: field names and meanings only change with a deprecation. Every field
is type-checked and validated at construction; a bad value raises
:class:`~lm_resiliency.errors.ConfigError` naming the field, the value and a
valid choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lm_resiliency.errors import ConfigError


def _int(owner: str, name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name}={value!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{owner}.{name}={value} is invalid; use an int >= {minimum}")


def _flag(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name}={value!r} must be True or False")


def _positive(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{owner}.{name}={value!r} must be a number")
    if not value >= 0 or (value == 0 and not allow_zero):  # also refuses NaN
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{owner}.{name}={value} is invalid; use a number {bound}")


@dataclass(frozen=True, kw_only=True)
class RecipeClass:
    """One class of recipes (dense blocks, optimizer, dynamic catalog): on/off and cadence."""

    enabled: bool = True
    """``False`` disables the class entirely."""

    interval: int | None = None
    """Steps between checks of this class; ``None`` uses :attr:`ScoutConfig.interval`."""

    def __post_init__(self) -> None:
        _flag("RecipeClass", "enabled", self.enabled)
        if self.interval is not None:
            _int("RecipeClass", "interval", self.interval, minimum=1)


@dataclass(frozen=True, kw_only=True)
class ScoutConfig:
    """What SCOUT checks, how often, and how it judges replay results and timings.

    With GEMINI, ``interval=None`` means GEMINI's capture interval, and every
    capture boundary runs a check first regardless of the class intervals (a
    capture needs an accepted result at its own step). See ``docs/scout.md``.
    """

    enable: bool = True
    """Master switch; a disabled SCOUT permits every capture and certifies nothing."""

    interval: int | None = None
    """Default interval of every recipe class; ``None``: GEMINI's ``interval`` (10 standalone)."""

    dense: RecipeClass = field(default_factory=RecipeClass)
    """Replay of one parameterised block of the model per check (rotating)."""

    optimizer: RecipeClass = field(default_factory=RecipeClass)
    """Comparison of the checked block's post-step parameters across replicas."""

    dynamic: RecipeClass = field(default_factory=RecipeClass)
    """One recipe of the dynamic catalog (e.g. MoE expert shapes) per check, if one is given."""

    seed: int = 0
    """Seed of the synthetic replay inputs and of the replay's dropout masks."""

    straggler_mad_factor: float = 5.0
    """A rank is a straggler candidate beyond median + this many scaled MADs of its peers."""

    straggler_floor_s: float = 0.005
    """... and at least this many seconds slower than its peers' median replay time."""

    straggler_min_slowdown: float = 2.0
    """... and at least this many times slower than that median. Confirmed by a re-run."""

    persist_certified: bool = True
    """Persist every certified capture (own slot and held peer replica) to node-local disk."""

    timeout_s: float = 120.0
    """Bound on every SCOUT collective (its private Gloo groups)."""

    def __post_init__(self) -> None:
        owner = "ScoutConfig"
        _flag(owner, "enable", self.enable)
        if self.interval is not None:
            _int(owner, "interval", self.interval, minimum=1)
        for name in ("dense", "optimizer", "dynamic"):
            value = getattr(self, name)
            if not isinstance(value, RecipeClass):
                raise ConfigError(
                    f"{owner}.{name}={value!r} must be a RecipeClass, e.g. "
                    f"RecipeClass(interval=20) or RecipeClass(enabled=False)"
                )
        if self.enable and not (self.dense.enabled or self.optimizer.enabled):
            raise ConfigError(
                f"{owner}: dense and optimizer recipes are both disabled, so no check could "
                "run at a capture boundary; enable one of them or set enable=False"
            )
        _int(owner, "seed", self.seed, minimum=0)
        _positive(owner, "straggler_mad_factor", self.straggler_mad_factor)
        _positive(owner, "straggler_floor_s", self.straggler_floor_s, allow_zero=True)
        _positive(owner, "straggler_min_slowdown", self.straggler_min_slowdown)
        if self.straggler_min_slowdown < 1:
            raise ConfigError(
                f"{owner}.straggler_min_slowdown={self.straggler_min_slowdown} is invalid; "
                "use a factor >= 1 such as 2.0"
            )
        _flag(owner, "persist_certified", self.persist_certified)
        _positive(owner, "timeout_s", self.timeout_s)

    def class_interval(self, name: str, default: int) -> int | None:
        """The interval of class ``name`` (``None`` when disabled); ``default`` is GEMINI's."""
        cls: RecipeClass = getattr(self, name)
        if not cls.enabled:
            return None
        if cls.interval is not None:
            return cls.interval
        return self.interval if self.interval is not None else default

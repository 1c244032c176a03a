"""Configuration of SCOUT (replay-based SDC and straggler detection).

Stable: field names and meanings only change with a deprecation. Every field
is type-checked and validated at construction; a bad value raises
:class:`~lm_resiliency.errors.ConfigError` naming the field, the value and a
valid choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lm_resiliency._validate import Rule, Rules, at_least, positive_time, validate
from lm_resiliency.detection.recipes import DynamicCatalog
from lm_resiliency.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RecipeClass:
    """One class of recipes (dense blocks, optimizer, dynamic catalog): on/off and cadence."""

    enabled: bool = True
    """``False`` disables the class entirely."""

    interval: int | None = None
    """Steps between checks of this class; ``None`` uses :attr:`ScoutConfig.interval`."""

    def __post_init__(self) -> None:
        validate(self, _RECIPE_RULES, prefix="RecipeClass.")


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

    catalog: DynamicCatalog | None = None
    """The dynamic catalog: modules sharing one architecture (MoE experts) and their
    shapes, ``DynamicCatalog(model.experts, shapes=[[(64, 512)], [(128, 512)]])`` (or
    discovered from the training with ``shapes=None``). With it the dynamic class
    checks one recipe per interval and certifies by cycles: a capture after a complete
    accepted cycle is a ``CANDIDATE`` (the framework writes its durable candidate) and
    becomes ``RECOVERY_VERIFIED`` after the next one. ``None``: dense recipes only."""

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

    pipeline: bool = True
    """Resolve a capture boundary's exchange at the next pre-step hook (``maybe_wait``)
    instead of at the boundary (the default); the capture is held uncommitted until
    then (so ``before_capture`` returns True provisionally, unless latched, and
    ``last_result`` is the verdict only after ``maybe_wait``). Needs a sink with
    ``hold`` (GEMINI's ``manager.trust``); otherwise the check resolves at once.
    ``False``: the synchronous check (the verdict at the boundary)."""

    def __post_init__(self) -> None:
        validate(self, _RULES, prefix="ScoutConfig.")
        if self.enable and not (self.dense.enabled or self.optimizer.enabled):
            raise ConfigError(
                "ScoutConfig: dense and optimizer recipes are both disabled, so no check could "
                "run at a capture boundary; enable one of them or set enable=False"
            )

    def class_interval(self, name: str, default: int) -> int | None:
        """The interval of class ``name`` (``None`` when disabled); ``default`` is GEMINI's."""
        cls: RecipeClass = getattr(self, name)
        if not cls.enabled:
            return None
        if cls.interval is not None:
            return cls.interval
        return self.interval if self.interval is not None else default


def _interval(example: str) -> Rule:
    return at_least(1, "is invalid; use an int >= 1", example)


_RECIPE_RULES: dict[str, Rules] = {"interval": _interval("RecipeClass(interval=10)")}

_ANY_RECIPE = Rule(lambda v: True, "", "RecipeClass(interval=20) or RecipeClass(enabled=False)")

_RULES: dict[str, Rules] = {
    "interval": _interval("interval=10"),
    # The annotation (a RecipeClass) is the whole check; the rule adds the example.
    "dense": _ANY_RECIPE,
    "optimizer": _ANY_RECIPE,
    "dynamic": _ANY_RECIPE,
    "catalog": Rule(
        lambda v: True, "", "catalog=DynamicCatalog(model.experts, shapes=[[(64, 512)]])"
    ),
    "seed": at_least(0, "is invalid; use an int >= 0", "seed=0"),
    "straggler_mad_factor": Rule(
        lambda v: v > 0, "is invalid; use a number > 0", "straggler_mad_factor=5.0"
    ),
    "straggler_floor_s": Rule(
        lambda v: v >= 0, "is invalid; use a number >= 0", "straggler_floor_s=0.005"
    ),
    "straggler_min_slowdown": (
        Rule(lambda v: v > 0, "is invalid; use a number > 0", "straggler_min_slowdown=2.0"),
        Rule(lambda v: v >= 1, "is invalid; use a factor >= 1 such as 2.0"),
    ),
    "timeout_s": positive_time("timeout_s=120"),
}
"""Ranges of :class:`ScoutConfig`'s fields (types come from the annotations)."""

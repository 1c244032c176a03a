"""Validation of config dataclasses, driven by their fields' annotations.

Each config calls :func:`validate` from ``__post_init__``. Every field is first
checked against its annotation, then against its :class:`Rule` if it has one:

* ``bool``: exactly ``True`` or ``False`` (``1``, ``"no"`` are refused);
* ``int``: an int and not a bool;
* ``float``: an int or float, not a bool, and finite;
* ``str``; ``Path`` (any ``os.PathLike``); ``None``; an ``Enum`` class (a member);
  ``Literal[...]`` (one of the values); ``frozenset[X]`` / ``tuple[X, ...]`` /
  ``list[X]`` (the container and each element); ``X | Y`` (either); any other
  class (an instance of it).

A rule runs only on a value that passed its type check and is not ``None``,
so it can compare freely. Adding a field to a config is one annotation, plus
one line in its rules table when it has a range (a tuple of rules when a field
has several conditions, each with its own message). Messages keep one style:
``<prefix><field>=<value!r> must be <type>[, e.g. <example>]`` for a wrong type
and ``<prefix><field>=<value!r> <rule.says>`` for a value out of range.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from lm_resiliency.errors import ConfigError
from lm_resiliency.knobs import MAX_WAIT_S

__all__ = ["Rule", "Rules", "at_least", "positive_time", "validate"]


@dataclass(frozen=True)
class Rule:
    """What a field's (correctly typed, non-``None``) value must satisfy.

    ``says`` follows ``field=value`` in the message and should name a valid
    choice ("is invalid; use a positive number of steps, e.g. interval=10");
    ``example`` is appended to type errors of the field (", e.g. interval=10").
    """

    ok: Callable[[Any], bool]
    says: str
    example: str = ""


def at_least(minimum: int, says: str, example: str = "") -> Rule:
    """``value >= minimum``."""
    return Rule(lambda v: v >= minimum, says, example)


Rules = Rule | tuple[Rule, ...]
"""What a rules table maps a field to: one rule, or several checked in order."""


def positive_time(example: str) -> Rule:
    """A number of seconds above zero and at most :data:`MAX_WAIT_S` (finiteness is the
    float type check): every timer a bound reaches (``threading``, ``timedelta``, Gloo's
    milliseconds) accepts it, where ``1e18`` would overflow one of them."""
    says = (
        f"is invalid; use a positive number of seconds up to {MAX_WAIT_S:.0f} (30 days), "
        f"e.g. {example}"
    )
    return Rule(lambda v: 0 < v <= MAX_WAIT_S, says, example)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:  # resolved once per class: string annotations need an eval
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def validate(obj: Any, rules: Mapping[str, Rules] | None = None, *, prefix: str = "") -> None:
    """Check every dataclass field of ``obj`` against its annotation and its rule.

    Call from ``__post_init__``. Raises ``ConfigError`` (a ``ValueError``)
    naming the first invalid field, its value and a valid choice. A rule for a
    field that does not exist is a programmer error (``AssertionError``).
    """
    rules = rules or {}
    hints = _hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    assert set(rules) <= set(names), sorted(set(rules) - set(names))
    for name in names:
        value = getattr(obj, name)
        hint = hints[name]
        given = rules.get(name, ())
        checks = given if isinstance(given, tuple) else (given,)
        rule = checks[0] if checks else None
        label = f"{prefix}{name}={value!r}"
        if not _accepts(value, hint):
            raise ConfigError(f"{label} must be {_describe(hint)}" + _example(rule))
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{label} must be a finite number" + _example(rule))
        for check in checks if value is not None else ():
            if not check.ok(value):
                raise ConfigError(f"{label} {check.says}")


def _example(rule: Rule | None) -> str:
    return f", e.g. {rule.example}" if rule is not None and rule.example else ""


def _members(hint: Any) -> tuple[Any, ...] | None:
    """The alternatives of a union annotation, else ``None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return None


def _accepts(value: Any, hint: Any) -> bool:
    members = _members(hint)
    if members is not None:
        return any(_accepts(value, m) for m in members)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return any(type(value) is type(v) and value == v for v in typing.get_args(hint))
    if origin in (frozenset, set, list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if not isinstance(value, origin):
            return False
        if origin is tuple and len(args) > 1 and Ellipsis not in typing.get_args(hint):
            return len(value) == len(args) and all(map(_accepts, value, args))
        return not args or all(_accepts(v, args[0]) for v in value)
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return isinstance(value, os.PathLike)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise AssertionError(f"annotation {hint!r} is not supported by lm_resiliency._validate")


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _describe(hint: Any) -> str:
    members = _members(hint)
    if members is not None:
        parts = [_describe(m) for m in members]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]
    if hint is type(None) or hint is None:
        return "None"
    if hint is bool:
        return "True or False"
    if hint is float:
        return "a number"
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if origin in (frozenset, set, list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        inner = f" whose items are each {_describe(args[0])}" if len(args) == 1 else ""
        return _article(origin.__name__) + inner
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"{_article(hint.__name__)} ({', '.join(m.name for m in hint)})"
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a Path"
    if isinstance(hint, type):
        return _article(hint.__name__)
    return repr(hint)

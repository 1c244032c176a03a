"""The suite's own layout: every test module has a unique basename.

The tests folders have no ``__init__.py``, so pytest imports each module by its basename; two
modules of one name (``tests/unit/test_x.py`` and ``tests/distributed/test_x.py``) stop the
whole collection with "import file mismatch" (a clean-clone CI run failed that way once).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_unique_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if names[p.name] > 1
    )

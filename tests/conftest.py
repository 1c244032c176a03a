"""Every test runs in its own empty working directory.

The manager's default ``disk_folder`` is ``./checkpoints``; running each test in a
fresh directory keeps node-local files of one test from ever reaching another
(or the checkout).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_cwd(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    return cwd

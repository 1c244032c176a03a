"""Every test runs in its own empty working directory and its own memory folder.

The manager's default ``disk_folder`` is ``./checkpoints`` and its default
``memory_folder`` ``/dev/shm/lm-resiliency``; running each test in a fresh
directory, with ``LM_RESILIENCY_MEMORY_FOLDER`` pointing at a fresh folder on
/dev/shm (removed afterwards), keeps node-local files and memory slots of one
test from ever reaching another (or the machine's real folder).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_SHM = Path("/dev/shm")

# Folders whose every test starts real processes (Gloo ranks, torchrun, network namespaces):
# marked ``multiprocess`` so that ``make check`` can leave them out; ``make test`` runs them all.
_MULTIPROCESS_FOLDERS = ("distributed", "faults", "frameworks")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(item.config.rootpath).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in _MULTIPROCESS_FOLDERS:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _isolated_cwd(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    return cwd


def _fresh_memory_folder(prefix: str) -> Path:
    base = _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@pytest.fixture(scope="session", autouse=True)
def _session_memory_folder() -> Iterator[Path]:
    """What module- and session-scoped fixtures (set up before any test's own folder) use,
    instead of the machine's real /dev/shm/lm-resiliency."""
    folder = _fresh_memory_folder("lmr-test-session-shm-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_RESILIENCY_MEMORY_FOLDER", str(folder / "lm-resiliency"))
        yield folder / "lm-resiliency"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_memory_folder(
    monkeypatch: pytest.MonkeyPatch, _session_memory_folder: Path
) -> Iterator[Path]:
    folder = _fresh_memory_folder("lmr-test-shm-")
    monkeypatch.setenv("LM_RESILIENCY_MEMORY_FOLDER", str(folder / "lm-resiliency"))
    yield folder / "lm-resiliency"
    shutil.rmtree(folder, ignore_errors=True)

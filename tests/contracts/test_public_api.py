"""The documented public surface: import names, the README's commands, CLI help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import lm_resiliency

ROOT = Path(__file__).resolve().parents[2]


def test_stable_api_names_are_exported() -> None:
    for name in ("InMemoryCkptConfig", "RecoveryMode", "ResiliencyError", "StepAborted"):
        assert name in lm_resiliency.__all__
        assert hasattr(lm_resiliency, name)
    from lm_resiliency.experimental import InMemoryCheckpointManager  # noqa: F401


STABLE_API = [
    "CaptureError",
    "CheckpointFormatError",
    "ConfigError",
    "IdentityMismatch",
    "InMemoryCkptConfig",
    "IntegrityError",
    "LiveConfig",
    "MTGSConfig",
    "NoConsistentStep",
    "RankFailures",
    "RecoveryMode",
    "ReplicationError",
    "ResiliencyConfig",
    "ResiliencyError",
    "ResiliencyHandle",
    "ScoutConfig",
    "StateEncodingError",
    "StepAborted",
    "__version__",
    "enable_resiliency",
    "estimate_chunk_size",
]
"""The stable API, frozen: changing ``lm_resiliency.__all__`` must change this list too."""


def test_the_stable_api_is_exactly_the_frozen_list() -> None:
    assert sorted(lm_resiliency.__all__) == sorted(STABLE_API)
    assert len(set(lm_resiliency.__all__)) == len(lm_resiliency.__all__)
    for name in STABLE_API:
        assert hasattr(lm_resiliency, name), name


def test_enable_resiliency_keeps_its_documented_signature() -> None:
    import inspect

    params = inspect.signature(lm_resiliency.enable_resiliency).parameters
    assert list(params) == [
        "model", "optimizer", "interval", "load_fallback", "save_durable", "state", "config",
        "mtgs", "scout", "failure_kind", "faults", "live",
    ]  # fmt: skip
    assert params["interval"].default == 10
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in list(params)[2:])


def test_readme_quickstart_names_the_make_targets_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile lacks target {target}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_make_extras_installs_every_optional_extra_and_ci_runs_it() -> None:
    # an extra CI does not install is code CI never runs: its tests are skipped there
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))
    assert {"dev", "hf", "nixl", "plot"} <= extras, extras
    makefile = (ROOT / "Makefile").read_text()
    (installed,) = re.findall(r"^\t.*pip install .*-e \"\.\[([\w,-]+)\]\"", makefile, re.M)[1:]
    assert set(installed.split(",")) == extras
    assert "make extras\nmake test" in (ROOT / ".ci" / "run").read_text()
    assert "`make extras`" in (ROOT / "README.md").read_text()


def test_readme_python_examples_compile() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["demo", "--help"],
        ["train", "--help"],
        ["inspect", "--help"],
        ["chunk-size", "--help"],
    ],
)
def test_cli_help_runs(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lm_resiliency.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: lm-resiliency" in out.stdout


def test_mtgs_trainer_module_help_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mtgs.trainer", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for flag in (
        "--mode",
        "--steps",
        "--mtgs-force-abort-step",
        "--mtgs-disable-hook",
        "--mtgs-disable-shadow",
        "--mtgs-disable-2pc",
        "--nproc",
    ):
        assert flag in out.stdout


def test_mtgs_compatibility_imports() -> None:
    from lm_resiliency.transactions import MTGS, MTGSConfig
    from mtgs import MTGSState, mtgs_comm_hook

    assert callable(mtgs_comm_hook) and MTGSState and MTGS and MTGSConfig

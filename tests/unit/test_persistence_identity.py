"""Run id resolution order and topology fingerprints (no process group)."""

from __future__ import annotations

import re

import pytest

from lm_resiliency.errors import ConfigError
from lm_resiliency.persistence import job_fingerprint, resolve_run_id, topology_fingerprint
from lm_resiliency.persistence.identity import local_run_id

BOTH = {"LM_RESILIENCY_RUN_ID": "from-env", "TORCHELASTIC_RUN_ID": "from-torchrun"}


def test_explicit_value_wins_over_both_environment_variables() -> None:
    assert local_run_id("explicit", env=BOTH) == ("explicit", "config")
    assert resolve_run_id("explicit", env=BOTH) == "explicit"


def test_lm_resiliency_env_wins_over_torchelastic() -> None:
    assert local_run_id(None, env=BOTH) == ("from-env", "LM_RESILIENCY_RUN_ID")
    assert resolve_run_id(env=BOTH) == "from-env"


def test_torchelastic_run_id_is_used_last() -> None:
    env = {"TORCHELASTIC_RUN_ID": "job-42"}
    assert local_run_id(None, env=env) == ("job-42", "TORCHELASTIC_RUN_ID")
    assert resolve_run_id(env=env) == "job-42"


@pytest.mark.parametrize("placeholder", ["none", "None", ""])
def test_torchruns_placeholder_is_not_an_identity(placeholder: str) -> None:
    assert local_run_id(None, env={"TORCHELASTIC_RUN_ID": placeholder}) == (None, "fresh")


def test_without_any_identity_each_job_gets_a_fresh_id() -> None:
    a, b = resolve_run_id(env={}), resolve_run_id(env={})
    assert re.fullmatch(r"[0-9a-f]{32}", a) and re.fullmatch(r"[0-9a-f]{32}", b)
    assert a != b


@pytest.mark.parametrize(
    ("run_id", "env", "match"),
    [
        ("", {}, "run_id from config is ''"),
        (None, {"LM_RESILIENCY_RUN_ID": ""}, "from LM_RESILIENCY_RUN_ID is ''"),
        ("x" * 257, {}, "257 bytes; use at most 256"),
    ],
)
def test_invalid_run_ids_are_config_errors(run_id: str | None, env: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        resolve_run_id(run_id, env=env)


def test_topology_fingerprint_is_deterministic_and_order_free() -> None:
    a = topology_fingerprint([0, 1, 2, 3], [(0, 2), (2, 0), (1, 3), (3, 1)])
    b = topology_fingerprint([3, 2, 1, 0], [(3, 1), (1, 3), (2, 0), (0, 2)])
    assert a == b and re.fullmatch(r"[0-9a-f]{64}", a)
    # Pinned: a restarted job must find its files again, in any process, on any host.
    assert a == "944937da1057ab6fc2b393b2e2eee9a4de85ece3255a2430c0c6080b1678ee3d"
    assert topology_fingerprint([0, 1, 2, 3], [(0, 1), (1, 0), (2, 3), (3, 2)]) != a
    assert topology_fingerprint([0, 1, 2, 3, 4], [(0, 2), (2, 0), (1, 3), (3, 1)]) != a


def test_topology_fingerprint_rejects_inconsistent_input() -> None:
    with pytest.raises(ConfigError, match="outside the group"):
        topology_fingerprint([0, 1], [(0, 5)])
    with pytest.raises(ConfigError, match="distinct"):
        topology_fingerprint([0, 0], [])


def test_job_fingerprint_depends_on_rank_order() -> None:
    f0 = topology_fingerprint([0], [])
    f1 = topology_fingerprint([1], [])
    assert job_fingerprint([f0, f1]) == job_fingerprint([f0, f1])
    assert job_fingerprint([f0, f1]) != job_fingerprint([f1, f0])
    with pytest.raises(ConfigError, match="64-hex"):
        job_fingerprint(["abc"])

"""The cross-replica group's backend choice and the NCCL error-handling environment (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.live.backend import (
    NCCL_ERROR_HANDLING_ENV,
    NCCL_ERROR_HANDLING_LEGACY_ENV,
    prepare_nccl_env,
    resolve_backend,
)


def test_backend_follows_the_tensors_device() -> None:
    assert resolve_backend(None, None) == "gloo"
    assert resolve_backend(None, "cpu") == "gloo"
    assert resolve_backend(None, torch.device("cuda", 1)) == "nccl"
    assert resolve_backend("gloo", "cpu") == "gloo"


def test_bad_backend_choices_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'mpi' is not one of \('gloo', 'nccl'\)"):
        resolve_backend("mpi", "cpu")
    with pytest.raises(ValueError, match="'nccl' needs CUDA tensors, but device is cpu"):
        resolve_backend("nccl", "cpu")


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_nccl_on_a_build_without_it_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"built without NCCL; .* backend='gloo'"):
        resolve_backend("nccl", "cuda")


def test_unset_error_handling_becomes_keep_the_process() -> None:
    env: dict[str, str] = {}
    assert prepare_nccl_env(env) == "2"
    assert env == {NCCL_ERROR_HANDLING_ENV: "2"}


@pytest.mark.parametrize("value", ["0", "2", " 2 "])
def test_values_that_keep_the_process_are_kept(value: str) -> None:
    env = {NCCL_ERROR_HANDLING_ENV: value}
    assert prepare_nccl_env(env) == value.strip()
    assert env[NCCL_ERROR_HANDLING_ENV] == value  # the user's setting is not rewritten


@pytest.mark.parametrize("name", [NCCL_ERROR_HANDLING_ENV, NCCL_ERROR_HANDLING_LEGACY_ENV])
@pytest.mark.parametrize(("value", "mode"), [("1", "TearDown"), ("3", "SkipCleanUp")])
def test_values_that_kill_the_process_are_refused(name: str, value: str, mode: str) -> None:
    env = {name: value}
    with pytest.raises(ValueError, match=rf"{name}={value} \({mode}\) .* kill this process"):
        prepare_nccl_env(env)
    assert env == {name: value}  # nothing set on the way out


def test_an_unknown_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"=.yes. is not a value torch knows"):
        prepare_nccl_env({NCCL_ERROR_HANDLING_ENV: "yes"})


def test_the_legacy_name_alone_is_carried_over() -> None:
    env = {NCCL_ERROR_HANDLING_LEGACY_ENV: "0"}
    assert prepare_nccl_env(env) == "0"
    assert env[NCCL_ERROR_HANDLING_ENV] == "0"

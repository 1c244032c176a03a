"""Run id and topology agreement on real 2-rank Gloo groups: agreed ids and clear mismatches."""

from __future__ import annotations

import re

import pytest

from lm_resiliency.errors import RankFailures
from lm_resiliency.persistence import (
    agree_job_fingerprint,
    job_fingerprint,
    resolve_run_id,
    topology_fingerprint,
)
from lm_resiliency.testing import run_distributed

TIMEOUT_S = 240


def _fresh(rank: int, world: int) -> str:
    return resolve_run_id(env={})


def test_ranks_without_identity_agree_on_one_fresh_id() -> None:
    ids = run_distributed(_fresh, 2, timeout_s=TIMEOUT_S)
    assert ids[0] == ids[1] and re.fullmatch(r"[0-9a-f]{32}", ids[0])
    again = run_distributed(_fresh, 2, timeout_s=TIMEOUT_S)
    assert again[0] == again[1] != ids[0]  # a new job inherits nothing


def _from_environment(rank: int, world: int) -> str:
    return resolve_run_id()  # reads os.environ as the launcher set it


def test_ranks_agree_on_the_environment_id() -> None:
    env = {"LM_RESILIENCY_RUN_ID": "job-7", "TORCHELASTIC_RUN_ID": "elastic"}
    assert run_distributed(_from_environment, 2, env=env, timeout_s=TIMEOUT_S) == ["job-7"] * 2


@pytest.mark.parametrize(
    "rank_env",
    [
        {0: {"LM_RESILIENCY_RUN_ID": "job-a"}, 1: {"LM_RESILIENCY_RUN_ID": "job-b"}},
        {0: {"LM_RESILIENCY_RUN_ID": "job-a"}, 1: {}},  # only one rank configured: no hang
    ],
    ids=["different-ids", "one-rank-without-id"],
)
def test_disagreeing_ranks_raise_identity_mismatch_on_every_rank(rank_env: dict) -> None:
    with pytest.raises(RankFailures) as info:
        run_distributed(_from_environment, 2, rank_env=rank_env, timeout_s=TIMEOUT_S)
    err = info.value
    assert err.ranks == [0, 1]
    for failure in err.failures.values():
        assert failure.exc_type == "IdentityMismatch"
        assert "ranks disagree on the run id" in failure.message
        assert "rank 0: run_id='job-a' (from LM_RESILIENCY_RUN_ID)" in failure.message


def _job_topology(rank: int, world: int, pairs_by_rank: dict[int, list[list[int]]]) -> str:
    ranks = [0, 1]
    fp = topology_fingerprint(ranks, [tuple(p) for p in pairs_by_rank[rank]])
    return agree_job_fingerprint(fp, group_ranks=ranks)


def test_ranks_derive_one_job_fingerprint() -> None:
    pairs = {0: [[0, 1], [1, 0]], 1: [[1, 0], [0, 1]]}
    out = run_distributed(_job_topology, 2, args=(pairs,), timeout_s=TIMEOUT_S)
    fp = topology_fingerprint([0, 1], [(0, 1), (1, 0)])
    assert out == [job_fingerprint([fp, fp])] * 2


def test_group_members_with_different_pairs_raise_identity_mismatch() -> None:
    pairs = {0: [[0, 1], [1, 0]], 1: [[0, 1]]}
    with pytest.raises(RankFailures) as info:
        run_distributed(_job_topology, 2, args=(pairs,), timeout_s=TIMEOUT_S)
    assert info.value.ranks == [0, 1]
    for failure in info.value.failures.values():
        assert failure.exc_type == "IdentityMismatch"
        assert "report a different group fingerprint" in failure.message

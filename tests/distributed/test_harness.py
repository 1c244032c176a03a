"""The multi-rank launcher itself: results, per-rank errors, hangs, scheduled kills."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.errors import RankFailures
from lm_resiliency.testing import kill_point, run_distributed


def _all_reduce(rank: int, world: int) -> list[float]:
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    dist.all_reduce(t)
    return t.tolist()


def test_four_rank_all_reduce_sums_on_every_rank() -> None:
    out = run_distributed(_all_reduce, 4, timeout_s=90)
    assert out == [[10.0, 60.0]] * 4


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise KeyError("broken shard on purpose")
    return rank


def test_exception_on_one_rank_names_the_rank_and_traceback() -> None:
    with pytest.raises(RankFailures) as info:
        run_distributed(_raise_on_rank_one, 2, timeout_s=60)
    err = info.value
    assert err.ranks == [1]
    assert err.failures[1].exc_type == "KeyError"
    assert "broken shard on purpose" in err.failures[1].message
    assert "_raise_on_rank_one" in err.failures[1].traceback
    assert "rank 1" in str(err)


def _hang_on_rank_two(rank: int, world: int) -> int:
    if rank == 2:
        time.sleep(3600)
    return rank


def test_hung_rank_is_killed_at_the_timeout_and_named_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_distributed(_hang_on_rank_two, 3, timeout_s=6, init_process_group=False)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.ranks == [2]
    assert err.failures[2].exc_type == "CollectiveTimeout"
    assert "still running" in err.failures[2].message
    assert "_hang_on_rank_two" in err.failures[2].traceback  # faulthandler stack dump


def _die_at_point(rank: int, world: int) -> str:
    kill_point("before-report")
    return f"rank{rank}"


def test_scheduled_kill_returns_none_for_the_dead_rank() -> None:
    out = run_distributed(_die_at_point, 3, kill={1: "before-report"}, init_process_group=False)
    assert out == ["rank0", None, "rank2"]


def test_unscheduled_death_is_a_failure() -> None:
    with pytest.raises(RankFailures) as info:
        run_distributed(
            _die_at_point,
            2,
            rank_env={0: {"LM_RESILIENCY_TEST_KILL": "before-report"}},
            init_process_group=False,
        )
    assert info.value.ranks == [0]
    assert "SIGKILL" in info.value.failures[0].message


def _env(rank: int, world: int) -> tuple[str, str, str]:
    import os

    return os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]


def test_ranks_per_node_sets_torchrun_style_env() -> None:
    out = run_distributed(_env, 4, ranks_per_node=2, init_process_group=False)
    assert out == [("0", "2", "0"), ("1", "2", "0"), ("0", "2", "1"), ("1", "2", "1")]

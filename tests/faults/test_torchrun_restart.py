"""Real torchrun restarts: the plain Gloo init fails after a restart, ours re-forms the group.

Every job runs ``torchrun_allreduce_worker.py`` under the real elastic agent
(c10d rendezvous on loopback): the first worker group all-reduces, then one
worker SIGKILLs itself and the others idle; torchrun restarts the group
(``--max-restarts=1``) and the new workers must form the group again and
all-reduce ``rank + 1`` over 4 ranks (= 10).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torchrun_allreduce_worker import SCRIPT, results

from lm_resiliency.testing.torchrun import free_port, run_torchrun, start_torchrun

pytestmark = pytest.mark.slow

_JOB_TIMEOUT_S = 240.0
# The plain call fails fast (connect refused); 60 s only bounds the case where a
# rank instead waits for a peer that will never answer.
_PG_TIMEOUT_S = "60"


# After the restart the last rank forms the group this much later than the others.
# The plain call's failure is a race: a new worker that reads a peer's address key
# before that peer re-published it gets the dead generation's address. When every
# new worker happens to publish before anyone reads, the plain call works; a late
# worker makes the bad order certain (and ours must cope with late workers anyway).
_STAGGER_S = "3"


def _crash_and_restart(init: str, marker: Path) -> list[str]:
    return [SCRIPT, "--init", init, "--kill-rank", "1", "--marker", str(marker),
            "--pg-timeout-s", _PG_TIMEOUT_S, "--rerun-stagger-s", _STAGGER_S]  # fmt: skip


def test_plain_init_process_group_fails_after_torchrun_restart(tmp_path: Path) -> None:
    # Documents the bug our init works around (torch 2.13): the agent's store is
    # shared by both worker groups, and the new group reads the dead group's
    # Gloo addresses. It shows as a Gloo error or, sometimes, as a hang that the
    # worker's watchdog turns into an exit. Its deadline: a restarted group that forms
    # at all does so in a few seconds (ours, with the same stagger, finishes the whole
    # job in ~15 s), so 25 s only bounds the hang.
    run = run_torchrun(
        [*_crash_and_restart("plain", tmp_path / "fault-done"), "--rerun-deadline-s", "25"],
        4,
        max_restarts=1,
        timeout_s=_JOB_TIMEOUT_S,
    )
    assert not run.timed_out, run.describe()
    assert run.attempts == 2, run.describe()
    assert [r.sum for r in results(run.stdout, "first")] == [10.0] * 4, run.describe()
    assert results(run.stdout, "rerun") == [], run.describe()
    assert run.returncode != 0
    gloo_errors = re.findall(r"connectFullMesh failed|Timed out waiting \d+ms for recv", run.stderr)
    assert gloo_errors or "RERUN-HUNG" in run.stdout, run.describe()


def test_our_init_process_group_reforms_group_after_torchrun_restart(tmp_path: Path) -> None:
    run = run_torchrun(
        _crash_and_restart("ours", tmp_path / "fault-done"),
        4,
        max_restarts=1,
        timeout_s=_JOB_TIMEOUT_S,
    )
    assert run.returncode == 0, run.describe()
    assert run.attempts == 2
    first = results(run.stdout, "first")
    assert [(r.attempt, r.rank, r.sum) for r in first] == [(0, rank, 10.0) for rank in range(4)]
    rerun = results(run.stdout, "rerun")
    assert [(r.attempt, r.rank, r.world, r.sum) for r in rerun] == [
        (1, rank, 4, 10.0) for rank in range(4)
    ]
    # Each worker's own log of the restarted group holds exactly its result.
    assert [len(results(out, "rerun")) for out in run.worker_stdout(1)] == [1, 1, 1, 1]


def test_our_init_process_group_reforms_group_when_nodes_disagree_on_restart_count(
    tmp_path: Path,
) -> None:
    # Two torchrun agents ("nodes") of 2 workers on loopback. Rank 3 (node B)
    # dies; node B's agent restarts its workers because they failed
    # (TORCHELASTIC_RESTART_COUNT -> 1) while node A's agent restarts its idle
    # workers because a node re-joined, which torchrun does not count (stays 0).
    # A store prefix built from the restart count would split the job in two.
    endpoint = f"127.0.0.1:{free_port()}"
    entry = [SCRIPT, "--init", "ours", "--kill-rank", "3", "--marker",
             str(tmp_path / "fault-done"), "--pg-timeout-s", _PG_TIMEOUT_S]  # fmt: skip
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    # Node A hosts the rendezvous store and sorts first (rendezvous rank 0 -> global
    # ranks 0 and 1, and the agent's shared store).
    node_a = start_torchrun(
        entry, 2, max_restarts=1, env=env, rdzv_endpoint=endpoint, nnodes="2",
        local_addr="127.0.0.1", extra_args=["--rdzv-conf=is_host=1"],
        workdir=tmp_path / "node-a",
    )  # fmt: skip
    node_b = start_torchrun(
        entry, 2, max_restarts=1, env=env, rdzv_endpoint=endpoint, nnodes="2",
        local_addr="127.0.0.2", extra_args=["--rdzv-conf=is_host=0"],
        workdir=tmp_path / "node-b",
    )  # fmt: skip
    run_a = node_a.wait(_JOB_TIMEOUT_S)
    run_b = node_b.wait(60.0)
    assert run_a.returncode == 0, run_a.describe()
    assert run_b.returncode == 0, run_b.describe()
    rerun = results(run_a.stdout + run_b.stdout, "rerun")
    assert [(r.rank, r.world, r.sum) for r in rerun] == [(rank, 4, 10.0) for rank in range(4)]
    assert [r.attempt for r in rerun] == [0, 0, 1, 1], "restart counts no longer diverge?"

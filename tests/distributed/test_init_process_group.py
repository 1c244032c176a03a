"""lm_resiliency.distributed.init_process_group on real Gloo ranks, without torchrun.

The launcher's parent ``TCPStore`` (at ``MASTER_ADDR``/``MASTER_PORT``) plays the
torchrun agent's shared store; setting ``TORCHELASTIC_USE_AGENT_STORE=True``
makes the ranks treat it as one. Stale records a dead generation would leave
are planted in it on purpose.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.distributed import init_process_group, restart_count
from lm_resiliency.errors import CollectiveTimeout, ConfigError
from lm_resiliency.testing import run_distributed
from lm_resiliency.testing.torchrun import free_port

_LEADER_KEY = "lm_resiliency/pg_leader"
_AGENT_ENV = {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _agent_store() -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )


class _ReportStaleSkips(logging.Handler):
    """Tells rank 0 (through the store) when this rank has rejected the stale record."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__(logging.INFO)
        self.store = store
        self.rank = rank
        self.ignored = False

    def emit(self, record: logging.LogRecord) -> None:
        if "ignoring stale" in record.getMessage():
            self.ignored = True
            self.store.set(f"test/rank{self.rank}-skipped-stale", "1")


def _form_group_past_stale_record(rank: int, world: int, stale: str) -> dict[str, object]:
    store = _agent_store()
    decoy: dist.TCPStore | None = None
    if rank == 0:
        if stale == "dead-port":
            record = {"host": "127.0.0.1", "port": free_port(), "nonce": "dead"}
        else:  # a live store that is not this generation's leader
            decoy = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            decoy.set("lm_resiliency/nonce", "someone-else")
            record = {"host": "127.0.0.1", "port": decoy.port, "nonce": "mine-long-ago"}
        store.set(_LEADER_KEY, json.dumps(record))
        store.set("test/stale-planted", "1")
    else:
        store.wait(["test/stale-planted"])
    handler = _ReportStaleSkips(store, rank)
    logging.getLogger("lm_resiliency.distributed").addHandler(handler)
    logging.getLogger("lm_resiliency.distributed").setLevel(logging.INFO)
    if rank == 0:
        # Publish only after every other rank has found and rejected the stale record.
        store.wait([f"test/rank{r}-skipped-stale" for r in range(1, world)])
    init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    nonce = json.loads(store.get(_LEADER_KEY))["nonce"]
    dist.barrier()  # keep the decoy alive until every rank is past it
    return {
        "sum": value.item(),
        "world": dist.get_world_size(),
        "nonce": nonce,
        "ignored": handler.ignored,
    }


@pytest.mark.parametrize("stale", ["dead-port", "wrong-nonce"])
def test_ranks_skip_a_dead_generations_record_and_form_the_group(stale: str) -> None:
    out = run_distributed(
        _form_group_past_stale_record,
        3,
        args=(stale,),
        env=_AGENT_ENV,
        init_process_group=False,
        timeout_s=150,
    )
    assert [o["sum"] for o in out] == [6.0, 6.0, 6.0]
    assert [o["world"] for o in out] == [3, 3, 3]
    nonces = {o["nonce"] for o in out}
    assert len(nonces) == 1
    assert nonces.isdisjoint({"dead", "mine-long-ago"})
    assert [o["ignored"] for o in out] == [False, True, True]


def _follower_without_leader(rank: int, world: int) -> str:
    store = _agent_store()
    if rank == 0:
        record = {"host": "127.0.0.1", "port": free_port(), "nonce": "dead"}
        store.set(_LEADER_KEY, json.dumps(record))
        store.set("test/stale-planted", "1")
        store.wait(["test/follower-done"])
        return "leader stayed away"
    store.wait(["test/stale-planted"])
    try:
        init_process_group("gloo", timeout=timedelta(seconds=3))
    except CollectiveTimeout as exc:
        return str(exc)
    finally:
        store.set("test/follower-done", "1")
    return "formed a group without rank 0"


def test_follower_times_out_naming_rank_when_rank_zero_never_publishes() -> None:
    out = run_distributed(
        _follower_without_leader, 2, env=_AGENT_ENV, init_process_group=False, timeout_s=120
    )
    message = out[1]
    assert message.startswith("rank 1: rank 0 of this torchrun generation published no live")
    assert "within 3s" in message
    assert "did not answer with nonce dead" in message


def _plain_with_explicit_store(rank: int, world: int) -> tuple[float, bool]:
    store = _agent_store()
    init_process_group("gloo", store=store, rank=rank, world_size=world)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.barrier()
    return value.item(), store.check([_LEADER_KEY])


def test_explicit_store_is_a_plain_call_even_under_torchrun() -> None:
    out = run_distributed(
        _plain_with_explicit_store, 2, env=_AGENT_ENV, init_process_group=False, timeout_s=90
    )
    assert out == [(3.0, False), (3.0, False)]


def test_restart_count_reads_torchrun_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert restart_count() == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "three")
    with pytest.raises(ConfigError, match=r"TORCHELASTIC_RESTART_COUNT='three' is not a non-neg"):
        restart_count()


def test_missing_master_addr_under_torchrun_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {**_AGENT_ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        init_process_group("gloo")
    assert not dist.is_initialized()

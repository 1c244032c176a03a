"""Process-group initialization that survives torchrun restarts.

Why this exists: since torch 2.4 the torchrun agent hosts one ``TCPStore`` for the
whole job (``TORCHELASTIC_USE_AGENT_STORE=True``; the c10d, standalone and static
rendezvous all do it) and hands the *same* ``MASTER_ADDR``/``MASTER_PORT`` to every
generation of workers. ``torch.distributed.init_process_group`` with ``env://``
then uses the same key names in that store in every generation, so after a
restart (``--max-restarts``) the new workers read the addresses the dead
generation published and Gloo fails with ``connectFullMesh failed ...
Connection refused`` (or waits for a peer that will never answer).

Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` fixes the single-node
case, but that count is kept by each node's agent and is not consistent across
a job: an agent whose workers are restarted because another node joined (a
membership change) does not increment it, and a replacement node starts at 0.
So the namespace here is chosen by global rank 0 of the new generation instead
and proven fresh by a liveness check that a dead generation cannot pass:

1. rank 0 starts a small ``TCPStore`` server of its own holding a random nonce,
   and publishes ``{host, port, nonce}`` under one key of the agent's store;
2. every other rank reads that record, connects to the advertised server and
   accepts the record only if the server answers with the same nonce. A record
   left by a dead generation points to a server that died with its rank 0
   (connection refused) or to a port now owned by someone else (wrong nonce),
   so the rank polls until the live record appears;
3. every rank then uses ``PrefixStore("lm_resiliency/generation/<nonce>/",
   agent store)`` for the default group. The agent's store outlives every
   worker, which is why torch moved it there; we keep using it.

Outside torchrun (or with an explicit ``store``/``init_method``, or when the
agent does not share its store) the call is exactly
``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lm_resiliency.errors import CollectiveTimeout, ConfigError

__all__ = ["init_process_group", "restart_count"]

logger = logging.getLogger(__name__)

_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_LEADER_KEY = "lm_resiliency/pg_leader"
_NONCE_KEY = "lm_resiliency/nonce"
# One probe must fail fast on a dead port; the whole search is bounded by the
# process-group timeout.
_PROBE_TIMEOUT_S = 2.0
_POLL_INTERVAL_S = 0.05

# Rank 0's nonce server must stay up until every rank has checked it; it is tiny
# (one listening socket) and is replaced when this process initializes again.
_leader_server: dist.TCPStore | None = None


def restart_count() -> int | None:
    """This worker's torchrun attempt number (0 first, +1 per local restart), or None.

    Read from ``TORCHELASTIC_RESTART_COUNT``, which the torchrun agent sets for
    every worker. The count is per node: in a multi-node job nodes can disagree
    (see the module docstring), so use it for logs and fault schedules, never to
    name something all ranks must agree on. Raises :class:`ConfigError` when the
    variable is set but not a non-negative integer.
    """
    raw = os.environ.get(_RESTART_ENV)
    if raw is None:
        return None
    if not raw.isdigit():
        raise ConfigError(
            f"{_RESTART_ENV}={raw!r} is not a non-negative integer; unset it or let torchrun set it"
        )
    return int(raw)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
) -> None:
    """Drop-in for :func:`torch.distributed.init_process_group` that works after torchrun restarts.

    Call it once per process, on every rank, where you would call torch's. When
    the process runs under torchrun with the agent's shared store
    (``TORCHELASTIC_USE_AGENT_STORE=True``), no ``store`` is given and
    ``init_method`` is ``None`` or ``"env://"``, the default group's store is the
    agent's ``TCPStore`` (``MASTER_ADDR``/``MASTER_PORT``, exactly as torch's
    ``env://`` builds it) wrapped in a prefix that is fresh for this generation
    of workers (module docstring), with ``rank``/``world_size`` from ``RANK``/
    ``WORLD_SIZE`` unless given. Every other case is a plain call with the same
    arguments.

    Guarantees: a restarted worker group re-forms the group however many times
    torchrun restarts it, whether or not the nodes' restart counts agree.
    Raises :class:`~lm_resiliency.errors.CollectiveTimeout` when rank 0 of this
    generation has not published a live record within ``timeout`` (default:
    torch's ``default_pg_timeout``), :class:`~lm_resiliency.errors.ConfigError`
    when a torchrun variable is missing or malformed, and whatever torch raises.
    """
    if store is None and init_method in (None, "env://") and _agent_store_shared():
        store, rank, world_size = _generation_store(rank, world_size, timeout)
        init_method = None
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=timeout,
        world_size=world_size,
        rank=rank,
        store=store,
        group_name=group_name,
        pg_options=pg_options,
        device_id=device_id,
    )


def _agent_store_shared() -> bool:
    # The same test torch's env:// rendezvous applies before it connects as a
    # client to the agent's store instead of hosting one on rank 0.
    return os.environ.get(_RESTART_ENV) is not None and os.environ.get(_AGENT_STORE_ENV) == "True"


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.isdigit():
        raise ConfigError(
            f"environment variable {name}={raw!r} must be a non-negative integer under "
            "torchrun; launch the script with torchrun or pass rank/world_size explicitly"
        )
    return int(raw)


def _generation_store(
    rank: int, world_size: int, timeout: timedelta | None
) -> tuple[dist.Store, int, int]:
    rank = rank if rank >= 0 else _env_int("RANK")
    world_size = world_size if world_size > 0 else _env_int("WORLD_SIZE")
    host = os.environ.get("MASTER_ADDR") or ""
    if not host:
        raise ConfigError("environment variable MASTER_ADDR is not set; torchrun sets it")
    port = _env_int("MASTER_PORT")
    store_timeout = timeout if timeout is not None else default_pg_timeout
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=store_timeout)
    nonce = _lead(agent, host) if rank == 0 else _follow(agent, rank, store_timeout)
    # The nonce alone names the generation: the restart count may differ by node.
    prefix = f"lm_resiliency/generation/{nonce}/"
    logger.info("rank %d: default process group uses store prefix %s", rank, prefix)
    return dist.PrefixStore(prefix, agent), rank, world_size


def _lead(agent: dist.Store, host: str) -> str:
    global _leader_server
    # Drop a server from an earlier init in this process first, so a follower can
    # never validate against it once the new record is published.
    _leader_server = None
    nonce = uuid.uuid4().hex
    # Global rank 0 runs on the node that hosts the agent's store (torchrun gives
    # rendezvous-rank-0's node the first global ranks and MASTER_ADDR), so the
    # others reach our server at MASTER_ADDR too. The server listens on all
    # interfaces on a kernel-chosen port.
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    server.set(_NONCE_KEY, nonce)
    _leader_server = server
    agent.set(_LEADER_KEY, json.dumps({"host": host, "port": server.port, "nonce": nonce}))
    return nonce


def _follow(agent: dist.Store, rank: int, timeout: timedelta) -> str:
    deadline = time.monotonic() + timeout.total_seconds()
    last = "no record yet"
    while True:
        # get() blocks until rank 0 of *some* generation published; bounded by the
        # store timeout.
        record = json.loads(agent.get(_LEADER_KEY))
        host, port, nonce = str(record["host"]), int(record["port"]), str(record["nonce"])
        if _leader_answers(host, port, nonce):
            return nonce
        reason = f"{host}:{port} did not answer with nonce {nonce[:8]}"
        if reason != last:  # once per stale record, not once per poll
            logger.info("rank %d: ignoring stale process-group record: %s", rank, reason)
        last = reason
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"rank {rank}: rank 0 of this torchrun generation published no live "
                f"process-group record within {timeout.total_seconds():.0f}s (last: {last}); "
                "check that rank 0 is running and reachable at MASTER_ADDR, or raise timeout"
            )
        time.sleep(_POLL_INTERVAL_S)


def _leader_answers(host: str, port: int, nonce: str) -> bool:
    # A plain connect first: a dead generation's port refuses at once, while a
    # TCPStore client would retry (and log) until its timeout.
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError:
        return False
    try:
        probe = dist.TCPStore(
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=_PROBE_TIMEOUT_S),
        )
        answer = probe.get(_NONCE_KEY).decode()
    except (RuntimeError, UnicodeDecodeError):  # DistError derives from RuntimeError
        return False
    return answer == nonce

"""A warm spare: a process that has imported torch and built its model, waiting to take over a
lost replica (docs/live-membership.md §6.3).

``lm-resiliency launch --warm-spares S`` starts S torchruns of one process with
``LMR_LIVE_SPARE=1``. The training script runs as usual up to ``enable_resiliency``, which
calls :func:`wait_for_takeover`: the spare takes a spare id (``add`` on ``spares``), says
hello on the liveness socket as replica ``-1`` (group rank: its spare id) and then waits on
that socket, costing no request, until the coordinator pokes it. The coordinator gives it a
lost replica's vacancy (``spare/<s>/take``, a :class:`~lm_resiliency.live.keys.Takeover`
whose incarnation it already swapped into ``owner/<r>/0``); the spare returns it, and the
front door registers as that replica's joiner and is healed from a member, as a restarted
replica is, without the seconds of a process start.

A worker whose own replica was taken over meanwhile (its torchrun restarted it after a spare
took its place: :class:`~lm_resiliency.live.view.ReplicaTaken`) waits here too, with
``own`` its replica: when that replica is vacant again it claims it back itself.

Only N = 1 (one process per replica group): a spare cannot enter another torchrun's
rendezvous. Every request is bounded by ``coordinator_timeout_s``; the liveness EOF or a
silent store is :class:`~lm_resiliency.live.view.CoordinatorLost`, and the ``"finished"``
epoch is :class:`~lm_resiliency.live.view.RunFinished` (the spare exits 0).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from lm_resiliency.live.bounded import Requester
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import OPEN, CoordRecord, EpochRecord, Keys, Takeover, decode
from lm_resiliency.live.liveness import LivenessClient
from lm_resiliency.live.membership import coordinator_address
from lm_resiliency.live.view import CoordinatorLost, RunFinished

__all__ = ["SPARE_ENV", "Spare", "Taken", "wait_for_takeover"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

SPARE_ENV = "LMR_LIVE_SPARE"
_BACKSTOP_S = 1.0
"""How often a waiting spare reads its keys without a poke (a poke is never lost; this only
bounds what a defect could cost)."""


@dataclass(frozen=True)
class Taken:
    """What :func:`wait_for_takeover` returns: the replica to register as, with the
    incarnation that holds its vacancy."""

    replica: int
    inc: str
    spare: int
    """This process's spare id."""
    waited_s: float
    """From the spare's hello to the takeover."""
    assigned_t: float
    """Wall-clock time the coordinator assigned it (or this process reclaimed its own)."""


class Spare:
    """One waiting spare's connection to the coordinator (:func:`wait_for_takeover` uses it)."""

    def __init__(self, config: LiveConfig, env: Mapping[str, str], *, own: int | None) -> None:
        host, port = coordinator_address(env)
        self.config = config
        self.keys = Keys(env.get("LMR_LIVE_RUN", ""))
        self.own = own
        self._host, self._port, self._address = host, port, f"{host}:{port}"
        self._requests = Requester(self._client, "lmr-live-spare-requests")
        self._liveness: LivenessClient | None = None
        self.spare = -1
        self.inc = uuid.uuid4().hex

    def _client(self) -> dist.Store:
        return dist.TCPStore(
            self._host,
            self._port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.config.coordinator_timeout_s),
        )

    def ask(self, request: Callable[[dist.Store], _T]) -> _T:
        return self._requests.ask(
            request,
            self.config.coordinator_timeout_s,
            address=self._address,
            who="live spare",
            then="the warm spare stops",
        )

    def connect(self) -> None:
        """Take a spare id and say hello (bounded by ``join_timeout_s`` for the coordinator)."""
        keys = self.keys
        deadline = time.monotonic() + self.config.join_timeout_s
        while not self.ask(lambda s: s.check([keys.coord])):
            if time.monotonic() > deadline:
                raise CoordinatorLost(
                    f"no coordinator record on {self._address} within join_timeout_s="
                    f"{self.config.join_timeout_s:g}"
                )
            time.sleep(self.config.poll_slice_s)
        coord = decode(CoordRecord, self.ask(lambda s: s.get(keys.coord)), key=keys.coord)
        self.spare = int(self.ask(lambda s: s.add(keys.spares, 1))) - 1
        self._liveness = LivenessClient(
            self._host,
            coord.live_port,
            replica=-1,
            group_rank=self.spare,
            inc=self.inc,
            timeout_s=self.config.coordinator_timeout_s,
        )

    def poll(self, timeout_s: float) -> Taken | None:
        """Wait up to ``timeout_s`` for a poke, then look: a takeover, or ``None``; raises
        ``RunFinished`` once the run is over."""
        assert self._liveness is not None, "connect() first"
        try:
            poked = self._liveness.wait(timeout_s)
        except ConnectionError as exc:
            raise CoordinatorLost(f"{exc}; the warm spare stops") from None
        keys = self.keys
        take = keys.spare_take(self.spare)
        if self.ask(lambda s: s.check([take])):
            got = decode(Takeover, self.ask(lambda s: s.get(take)), key=take)
            return Taken(got.replica, got.inc, self.spare, 0.0, got.t)
        if self.own is not None:
            owner = keys.owner(self.own, 0)
            value = self.ask(lambda s: s.get(owner)).decode() if self.ask(
                lambda s: s.check([owner])) else ""  # fmt: skip
            if value.startswith(OPEN):
                inc = uuid.uuid4().hex
                if self.ask(lambda s: s.compare_set(owner, value, inc)) == inc.encode():
                    return Taken(self.own, inc, self.spare, 0.0, time.time())
        if poked or self.ask(lambda s: s.check([keys.epoch])):
            current = int(self.ask(lambda s: s.get(keys.epoch)))
            key = keys.epoch_record(current)
            record = decode(EpochRecord, self.ask(lambda s: s.get(key)), key=key)
            if record.reason == "finished":
                raise RunFinished(record.epoch, record.resume_step, record.cause)
        return None

    def close(self) -> None:
        if self._liveness is not None:
            self._liveness.close()
        self._requests.close()


def wait_for_takeover(
    config: LiveConfig, env: Mapping[str, str] | None = None, *, own: int | None = None
) -> Taken:
    """Wait as a warm spare until this process is given a replica (see the module doc).

    ``own``: the replica this process was started for, when a spare took it over first; it
    claims it back once it is vacant again. Raises ``CoordinatorLost`` or ``RunFinished``.
    """
    spare = Spare(config, os.environ if env is None else env, own=own)
    try:
        spare.connect()
        hello = time.monotonic()
        log.warning(
            "live membership: warm spare %d (pid %d) waiting to take over a lost replica%s",
            spare.spare,
            os.getpid(),
            "" if own is None else f" (or its own replica {own} when it is vacant again)",
        )
        while True:
            got = spare.poll(_BACKSTOP_S)
            if got is not None:
                waited = time.monotonic() - hello
                log.warning(
                    "live membership: warm spare %d (pid %d) takes over replica %d after "
                    "waiting %.1f s",
                    got.spare,
                    os.getpid(),
                    got.replica,
                    waited,
                )
                return Taken(got.replica, got.inc, got.spare, waited, got.assigned_t)
    finally:
        spare.close()

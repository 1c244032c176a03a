"""Who replicates to whom: ``replication_jump`` resolved into a pairing plan.

Rank ``r`` sends its state to ``(r + jump) % world_size`` and holds the state of
``(r - jump) % world_size``. With ``jump`` equal to the ranks per node, a rank's
replica sits on the next node; ``2 * jump == world_size`` gives symmetric pairs,
anything smaller a ring over the nodes. Requiring ``world_size % jump == 0``
keeps every ring the same length and aligned to node boundaries.

Call order: :func:`resolve_jump` (turns ``-1`` into a concrete distance, once
per job, on every rank with the same inputs) -> :meth:`PairingPlan.build`. Both
are pure functions of their arguments and the environment: every rank computes
the same plan without communicating.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lm_resiliency.errors import ConfigError, ReplicationError

log = logging.getLogger(__name__)

AUTO_JUMP = -1
"""``replication_jump`` value meaning "one node width" (the ranks per node)."""

_logged_once: set[str] = set()


def _log_once(level: int, message: str) -> None:
    # Pairing is resolved on every rank and possibly by several managers; one line
    # per process is enough to explain the choice.
    if message not in _logged_once:
        _logged_once.add(message)
        log.log(level, message)


def _divisors_below(world_size: int) -> list[int]:
    return [d for d in range(1, world_size) if world_size % d == 0]


def _suggest(jump: int, world_size: int) -> int:
    """The valid jump closest to ``jump`` (ties go to the larger one)."""
    return min(_divisors_below(world_size), key=lambda d: (abs(d - jump), -d))


def _check_jump(jump: int, world_size: int, origin: str) -> None:
    """Raise ``ConfigError`` unless ``jump`` is a valid distance for ``world_size > 1``."""
    if jump <= 0:
        raise ConfigError(
            f"{origin} is invalid: use {AUTO_JUMP} (one node width) or a positive divisor "
            f"of world_size={world_size} smaller than {world_size}, such as "
            f"{_suggest(world_size // 2, world_size)}"
        )
    if jump >= world_size:
        raise ConfigError(
            f"{origin} must be smaller than world_size={world_size} (a rank cannot hold "
            f"its own replica); use a divisor of {world_size} such as "
            f"{_suggest(jump, world_size)}"
        )
    if world_size % jump:
        raise ConfigError(
            f"{origin} does not divide world_size={world_size}; use a divisor of "
            f"{world_size} such as {_suggest(jump, world_size)}"
        )


@dataclass(frozen=True)
class JumpDecision:
    """The outcome of :func:`resolve_jump`.

    ``jump`` is ``None`` when there is no peer (world size 1). ``ranks_per_node``
    and ``source`` say where the node width came from (``"explicit"``,
    ``"LOCAL_WORLD_SIZE"``, ``"cuda.device_count"`` or ``"fallback"``);
    ``within_node`` is true when pairs were placed inside one node, so replicas
    survive a process loss but not a node loss.
    """

    jump: int | None
    ranks_per_node: int | None
    source: str
    within_node: bool


def _ranks_per_node(env: Mapping[str, str], gpu_count: Callable[[], int]) -> tuple[int, str]:
    raw = env.get("LOCAL_WORLD_SIZE")
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE={raw!r} is not a positive integer; fix the launcher "
                "environment or set replication_jump explicitly"
            )
        return value, "LOCAL_WORLD_SIZE"
    gpus = gpu_count()
    if gpus > 0:
        return gpus, "cuda.device_count"
    return 1, "fallback"


def _cuda_device_count() -> int:
    return int(torch.cuda.device_count())


def resolve_jump(
    replication_jump: int,
    world_size: int,
    *,
    env: Mapping[str, str] = os.environ,
    gpu_count: Callable[[], int] = _cuda_device_count,
) -> JumpDecision:
    """Turn a configured ``replication_jump`` into the rank distance to replicate over.

    ``-1`` means one node width: ``LOCAL_WORLD_SIZE`` when a launcher such as
    torchrun set it, else the visible GPU count (``gpu_count``), else 1 with a
    warning that a rank and its peer may then share a node. When that width
    covers the whole job (one node), ranks pair within the node, half the world
    apart, and a note says once that replicas then protect against process loss,
    not node loss. A positive value is used as given after validation. World
    size 1 yields ``jump=None`` (no peer) for any value.

    Call it on every rank with the same arguments; it does not communicate.
    Raises :class:`~lm_resiliency.errors.ConfigError` naming the value and a valid
    choice when the jump is not positive, not below ``world_size`` or does not
    divide it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be a positive integer")
    if isinstance(replication_jump, bool) or not isinstance(replication_jump, int):
        raise ConfigError(
            f"replication_jump={replication_jump!r} must be an integer: {AUTO_JUMP} or a "
            "positive rank distance"
        )
    if world_size == 1:
        return JumpDecision(jump=None, ranks_per_node=None, source="explicit", within_node=False)

    if replication_jump != AUTO_JUMP:
        _check_jump(replication_jump, world_size, f"replication_jump={replication_jump}")
        per_node_raw = env.get("LOCAL_WORLD_SIZE", "")
        per_node = int(per_node_raw) if per_node_raw.isdigit() else 0
        if per_node > 0 and per_node < world_size and replication_jump % per_node:
            _log_once(
                logging.WARNING,
                f"replication_jump={replication_jump} is not a multiple of "
                f"LOCAL_WORLD_SIZE={per_node}: some ranks replicate to a peer on their own "
                "node, and losing that node loses both copies",
            )
        return JumpDecision(
            jump=replication_jump, ranks_per_node=None, source="explicit", within_node=False
        )

    per_node, source = _ranks_per_node(env, gpu_count)
    if source == "fallback":
        _log_once(
            logging.WARNING,
            "replication_jump=-1: ranks per node unknown (no LOCAL_WORLD_SIZE, no visible "
            "GPU); using 1, so a rank and its peer may share a node and a node loss can "
            "take both copies; set replication_jump to the number of ranks per node",
        )
    if per_node >= world_size:
        jump = world_size // 2
        _log_once(
            logging.INFO,
            f"replication_jump=-1: all {world_size} ranks run on one node ({source}="
            f"{per_node}); pairing within the node at jump {jump}, so replicas protect "
            "against a process loss, not a node loss",
        )
        return JumpDecision(jump=jump, ranks_per_node=per_node, source=source, within_node=True)
    _check_jump(per_node, world_size, f"replication_jump=-1 (resolved to {source}={per_node})")
    return JumpDecision(jump=per_node, ranks_per_node=per_node, source=source, within_node=False)


@dataclass(frozen=True)
class PairingPlan:
    """The replication assignment of a job: identical on every rank.

    Build it with :meth:`build`. ``jump`` is ``None`` when the job has no peer
    (world size 1); then :attr:`has_peer` is false and :meth:`table` is empty.
    """

    world_size: int
    jump: int | None

    @classmethod
    def build(cls, world_size: int, jump: int | None) -> PairingPlan:
        """Validate ``jump`` for ``world_size`` and return the plan.

        World size 1 has no peer whatever ``jump`` says: the plan records that and
        one log line explains that replication is off. Otherwise ``jump`` must be a
        positive divisor of ``world_size`` below it (``ConfigError`` otherwise).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r} must be a positive integer")
        if world_size == 1:
            _log_once(
                logging.INFO,
                "world_size=1: no peer rank to replicate to; in-memory checkpoints stay "
                "local (process crashes are covered only by node-local files)",
            )
            return cls(world_size=1, jump=None)
        if jump is None or isinstance(jump, bool) or not isinstance(jump, int):
            raise ConfigError(
                f"replication jump {jump!r} must be an integer for world_size={world_size}; "
                f"use a divisor of {world_size} such as {_suggest(world_size // 2, world_size)}"
            )
        _check_jump(jump, world_size, f"replication_jump={jump}")
        return cls(world_size=world_size, jump=jump)

    @property
    def has_peer(self) -> bool:
        """Whether ranks replicate at all (false for world size 1)."""
        return self.jump is not None

    @property
    def symmetric(self) -> bool:
        """True when each rank's sender and receiver are the same peer (``2*jump == world``)."""
        return self.jump is not None and 2 * self.jump == self.world_size

    def _distance(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside world_size={self.world_size}")
        if self.jump is None:
            raise ReplicationError(
                f"rank {rank} has no replication peer: world_size={self.world_size}"
            )
        return self.jump

    def send_to(self, rank: int) -> int:
        """The rank that holds ``rank``'s replica."""
        return (rank + self._distance(rank)) % self.world_size

    def recv_from(self, rank: int) -> int:
        """The rank whose replica ``rank`` holds."""
        return (rank - self._distance(rank)) % self.world_size

    def table(self) -> list[tuple[int, int]]:
        """Every ``(owner, holder)`` edge in owner order; empty without a peer."""
        if self.jump is None:
            return []
        return [(r, self.send_to(r)) for r in range(self.world_size)]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description (logs, the inspect CLI, the topology fingerprint)."""
        return {
            "world_size": self.world_size,
            "jump": self.jump,
            "symmetric": self.symmetric,
            "pairs": [list(edge) for edge in self.table()],
        }

    def describe(self) -> str:
        """One line for logs: the jump, the shape and the first few edges."""
        if self.jump is None:
            return f"world_size={self.world_size}: no replication peer"
        shape = "symmetric pairs" if self.symmetric else f"rings of {self.world_size // self.jump}"
        edges = ", ".join(f"{s}->{d}" for s, d in self.table()[:8])
        more = " ..." if self.world_size > 8 else ""
        return f"world_size={self.world_size} jump={self.jump} ({shape}): {edges}{more}"

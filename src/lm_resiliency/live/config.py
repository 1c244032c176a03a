"""LiveConfig: the timings and limits of live membership (docs/live-membership.md §2.4, §8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lm_resiliency._validate import Rule, at_least, positive_time, validate
from lm_resiliency.errors import ConfigError

__all__ = ["LiveConfig"]


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """Configuration of live membership (one coordinator, R replica groups of N ranks).

    Keyword-only; raises ``ConfigError`` naming the field, its value and a fix when a value
    is invalid. The coordinator uses the detection timings (``lease_s``, ``stale_s``,
    ``decision_tick_s``, ``min_replicas``); the workers use the rest.
    """

    heartbeat_s: float = 0.1
    """Interval of each rank's heartbeat (its own thread and its own store client)."""

    lease_s: float = 0.5
    """A rank with no heartbeat for this long is lost (covers SIGSTOP, a wedged process, a node
    gone without a FIN). Must be >= 3 x ``heartbeat_s``."""

    stale_s: float = 0.25
    """While acks are collected, a rank whose heartbeat is older than this counts as dead and
    does not hold up the change. Between ``heartbeat_s`` and ``lease_s``."""

    poll_slice_s: float = 0.05
    """Slice of every polled wait (a collective, the next epoch record)."""

    decision_tick_s: float = 0.01
    """Period of the coordinator's decision loop (a liveness EOF wakes it at once)."""

    ack_timeout_s: float = 60.0
    """During a change, how long the coordinator waits for the ack of a rank whose heartbeat is
    fresh. A survivor acks when its training thread reaches its next collective, so this must
    cover one step's compute (with gradient accumulation, a whole step); a rank that is still
    heartbeating but has not acked by then (its training thread is wedged) is dropped. Dead and
    silent ranks never hold the change up (``stale_s``)."""

    reform_timeout_s: float = 5.0
    """A worker that sees no ``epoch/<E+1>`` within this plus ``ack_timeout_s`` after acking
    falls back (``CoordinatorLost``)."""

    coordinator_timeout_s: float = 3.0
    """A worker that sees ``coord/beat`` unchanged for this long falls back
    (``CoordinatorLost``). Also bounds each request to the coordinator's store."""

    join_timeout_s: float = 600.0
    """Bound on a worker's wait for the first epoch, and on a joiner's wait for admission."""

    heal_timeout_s: float = 30.0
    """Bound on each wait of a heal transfer (not the whole transfer)."""

    pg_timeout_s: float = 30.0
    """Timeout of each epoch's cross-replica group (bounds abandoned Gloo threads; NCCL's
    watchdog timeout)."""

    min_replicas: int = 1
    """Fewer surviving replicas than this: the new epoch has no members and every worker falls
    back to a whole-job restart with memory recovery."""

    max_membership_changes: int | None = None
    """Membership changes one step may go through before it fails; ``None``: R."""

    digest_every: int = 0
    """Log the state digest with every k-th commit (``0``: never; it costs a pass over the
    parameters)."""

    loss_reduction: Literal["mean", "sum"] = "mean"
    """How the user's loss reduces over the local samples: ``"mean"`` (weight ``n_i/B``) or
    ``"sum"`` (weight ``1/B``)."""

    reseed_all: bool = False
    """Also reseed Python's and NumPy's generators at each step (torch's always are)."""

    def __post_init__(self) -> None:
        validate(self, _RULES, prefix="LiveConfig.")
        if self.lease_s < 3 * self.heartbeat_s * (1 - 1e-9):  # 3 x 0.2 is 0.6000000000000001
            raise ConfigError(
                f"LiveConfig.lease_s={self.lease_s!r} must be >= 3 x heartbeat_s="
                f"{self.heartbeat_s!r} (a lease must survive two late heartbeats); raise lease_s "
                f"to {3 * self.heartbeat_s:g} or lower heartbeat_s to {self.lease_s / 3:g}"
            )
        if not self.heartbeat_s <= self.stale_s <= self.lease_s:
            raise ConfigError(
                f"LiveConfig.stale_s={self.stale_s!r} must lie between heartbeat_s="
                f"{self.heartbeat_s!r} and lease_s={self.lease_s!r}; e.g. stale_s="
                f"{min(self.lease_s, max(self.heartbeat_s, self.lease_s / 2)):g}"
            )

    def changes_per_step(self, replicas: int) -> int:
        """``max_membership_changes``, with ``None`` resolved to ``replicas`` (R)."""
        return replicas if self.max_membership_changes is None else self.max_membership_changes


_RULES = {
    "heartbeat_s": positive_time("heartbeat_s=0.1"),
    "lease_s": positive_time("lease_s=0.5"),
    "stale_s": positive_time("stale_s=0.25"),
    "poll_slice_s": positive_time("poll_slice_s=0.05"),
    "decision_tick_s": positive_time("decision_tick_s=0.01"),
    "ack_timeout_s": positive_time("ack_timeout_s=60"),
    "reform_timeout_s": positive_time("reform_timeout_s=5"),
    "coordinator_timeout_s": positive_time("coordinator_timeout_s=3"),
    "join_timeout_s": positive_time("join_timeout_s=600"),
    "heal_timeout_s": positive_time("heal_timeout_s=30"),
    "pg_timeout_s": positive_time("pg_timeout_s=30"),
    "min_replicas": at_least(1, "must be >= 1 (replicas that must survive)", "min_replicas=1"),
    "max_membership_changes": Rule(
        lambda v: v >= 1,
        "must be >= 1, or None for R (one change per replica)",
        "max_membership_changes=None",
    ),
    "digest_every": at_least(0, "must be >= 0 (0: never)", "digest_every=0"),
}

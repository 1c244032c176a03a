"""How the two endpoints of a broken edge agree on a rebuild before either connects.

Connecting blindly at a key both derive from the step is not enough. When one
side is late by more than ``timeout_s`` the other gives up the connect, and the
late side then connects to the address the first left in the store: the
listener behind it is gone, and Gloo retries the refused connection for several
times ``timeout_s``. That late side then starts its next cycle late again, so
replication never heals (issue 20, item 1). So every rebuild goes through the
job's store first, and nobody ever connects on an attempt the peer abandoned:

* each step's rebuild of an edge has numbered *attempts*; ``current`` (an
  atomic counter) names the one to join;
* *join*: the first endpoint to arrive waits for the second, up to
  ``timeout_s``; the second marks the attempt ``go``. (No longer: a peer that
  stalls past it finds the attempt marked ``gone`` and fails at once, so it is
  not late for the next cycle, and a stall longer than the bound costs exactly
  the cycle it hit.) A first endpoint that waited in vain marks it ``gone`` with
  ``compare_set``, so exactly one of the two marks wins and both read the same
  outcome: both connect, or neither does;
* both connect a fresh Gloo group under that attempt's own keys, then publish
  whether it worked and read the peer's result (waiting up to ``2 * timeout_s``:
  the peer's connect may take its whole ``timeout_s`` after ours failed at once).
  Both ok: connected. Otherwise both move to the next attempt and connect
  again, up to ``attempts`` times within the cycle;
* an endpoint whose transfer for a step failed for good *closes* that step:
  it marks the current attempt ``gone``, so a peer that arrives later (it
  stalled, or it was busy failing elsewhere) learns at once that nobody is
  coming, instead of waiting out a timeout that would make it late again.

Store keys live under ``<edge prefix>/rebuild/<step>/``, a few per rebuild.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from lm_resiliency.errors import ReplicationError

_GO = "go"
_CONNECTED = "connected"
_RETRY = "retry"


class PeerGaveUp(ReplicationError):
    """The peer abandoned this step's rebuild (it will not come to connect)."""


class JoinTimeout(ReplicationError):
    """The peer did not arrive at the rebuild, or report its connect, in time."""


class ConnectFailed(ReplicationError):
    """Every connect failed on one side or the other, although both endpoints met."""


class Rebuilds:
    """The rebuild agreement of one edge, as seen from endpoint ``me`` (0 or 1)."""

    def __init__(self, store: Store, prefix: str, *, me: int, timeout_s: float) -> None:
        self._store = PrefixStore(f"{prefix}/rebuild/", store)
        self._me = me
        self._join_timeout = timedelta(seconds=timeout_s)
        # The peer's connect started when ours did but may take its whole timeout_s after
        # ours failed at once (a refused connect): wait for its result a bound beyond that.
        self._settle_timeout = timedelta(seconds=2 * timeout_s)

    def rebuild(self, step: int, connect: Callable[[Store], Any], *, attempts: int) -> Any:
        """Join the peer for ``step``'s rebuild and return ``connect(store)``'s group.

        ``connect`` builds the group on the store it is given (a fresh key space
        per attempt) and raises ``ReplicationError`` (or Gloo's ``RuntimeError``)
        when that fails. Raises ``JoinTimeout`` when the peer did not come, ``PeerGaveUp`` when it
        abandoned the step, ``ConnectFailed`` when ``attempts`` connects failed.
        """
        last: Exception | None = None
        for _ in range(attempts):
            attempt = self._join(step)
            keys = f"{step}/{attempt}"
            group: Any = None
            try:
                group = connect(PrefixStore(f"{keys}/pg/", self._store))
            except (ReplicationError, RuntimeError) as exc:  # ours, or Gloo's own
                last = exc
            else:
                last = None
            outcome = self._settle(keys, ok=group is not None)
            self._advance(step, attempt)
            if outcome == _CONNECTED:
                return group
            group = None  # its sockets close; the peer drops its side too
            if outcome != _RETRY:
                raise self._gave_up(outcome, "connecting") from last
        detail = "the peer's connect failed" if last is None else str(last)
        raise ConnectFailed(f"the last one: {detail}") from last

    def close(self, step: int) -> None:
        """This endpoint is done with ``step``: a peer waiting for it or coming later is told.

        Never raises (it runs while another error propagates).
        """
        with contextlib.suppress(RuntimeError):
            attempt = self._current(step)
            self._mark(f"{step}/{attempt}/start", self._gone(self._me))

    # -- the steps of one attempt ------------------------------------------------

    def _join(self, step: int) -> int:
        while True:
            attempt = self._current(step)
            keys = f"{step}/{attempt}"
            arrived = self._store.add(f"{keys}/arrivals", 1)
            waited_in_vain = False
            if arrived == 1:
                mark, waited_in_vain = self._wait_for(f"{keys}/start")
            elif arrived == 2:
                mark = self._mark(f"{keys}/start", _GO)
            else:  # used up by an earlier rebuild of this step
                self._advance(step, attempt)
                continue
            if mark == _GO:
                return attempt
            if waited_in_vain:  # the attempt stays marked, so a late peer learns at once
                seconds = self._join_timeout.total_seconds()
                raise JoinTimeout(f"the peer did not come within {seconds:g} s")
            self._advance(step, attempt)
            if mark != self._gone(self._me):  # else: our own mark from an earlier call
                raise self._gave_up(mark, "meeting")

    def _settle(self, keys: str, *, ok: bool) -> str:
        self._store.set(f"{keys}/result{self._me}", "ok" if ok else "failed")
        peer_result = f"{keys}/result{1 - self._me}"
        try:
            self._store.wait([peer_result], self._settle_timeout)
        except RuntimeError:
            decision = self._gone(self._me)
        else:
            both = ok and self._store.get(peer_result) == b"ok"
            decision = _CONNECTED if both else _RETRY
        return self._mark(f"{keys}/end", decision)

    def _wait_for(self, key: str) -> tuple[str, bool]:
        """The mark at ``key`` once there, and whether it is ours from waiting in vain."""
        try:
            self._store.wait([key], self._join_timeout)
        except RuntimeError:
            # Exactly one of our "gone" and the peer's "go" lands; read which.
            mark = self._mark(key, self._gone(self._me))
            return mark, mark == self._gone(self._me)
        return bytes(self._store.get(key)).decode(), False

    def _current(self, step: int) -> int:
        return int(self._store.add(f"{step}/current", 0))

    def _advance(self, step: int, attempt: int) -> None:
        self._store.compare_set(f"{step}/current", str(attempt), str(attempt + 1))

    def _gave_up(self, mark: str, during: str) -> ReplicationError:
        if mark == self._gone(self._me):
            seconds = self._settle_timeout.total_seconds()
            return JoinTimeout(f"the peer did not report its connect within {seconds:g} s")
        return PeerGaveUp(f"the peer gave up this step's transfer ({during})")

    def _mark(self, key: str, desired: str) -> str:
        """Set ``key`` to ``desired`` unless it is set; return what it holds now."""
        return bytes(self._store.compare_set(key, "", desired)).decode()

    @staticmethod
    def _gone(endpoint: int) -> str:
        return f"gone{endpoint}"

"""One replication edge: a private two-rank Gloo group between an owner and its holder.

Why a private group per edge, and not one replication group for the whole job:
when a Gloo wait times out, Gloo closes *every* connection of that group on the
waiting rank ("Application timeout caused pair closure"), and the other side
then sees "Connection closed by peer" on its next operation. A timed-out group
is dead for good. Rebuilding a shared group needs every rank of the job at the
same moment (``new_group`` is collective), which a background transfer cannot
arrange. A two-rank group only needs its two endpoints: after a failure both
know the edge is broken, and both rebuild it at the start of their next transfer
for the same step (the replication schedule is the same on every rank), after
agreeing in the store on the attempt both join (:mod:`._rebuild`).

The group is a ``ProcessGroupGloo`` built directly on a ``PrefixStore`` of the
job's store, so its rendezvous is bounded by our timeout and it is not
registered in ``torch.distributed``'s global group table.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from lm_resiliency.errors import ReplicationError
from lm_resiliency.knobs import REPLICATION_REBUILD_ATTEMPTS
from lm_resiliency.replication._rebuild import ConnectFailed, JoinTimeout, PeerGaveUp, Rebuilds

log = logging.getLogger(__name__)

# A tag no message of the protocol uses (see _wire.Tag).
_CLOSE_TAG = 1000


class Edge:
    """The directed edge ``owner -> holder`` as seen from ``rank`` (one of the two).

    Not thread-safe: one thread at a time drives an edge. Every wait is bounded by
    ``timeout_s``; any failure marks the edge broken, and :meth:`ensure` rebuilds
    it before the next transfer.
    """

    def __init__(
        self,
        *,
        owner: int,
        holder: int,
        rank: int,
        store: Store,
        prefix: str,
        timeout_s: float,
    ) -> None:
        if rank not in (owner, holder) or owner == holder:
            raise ValueError(f"rank {rank} is not an endpoint of edge {owner}->{holder}")
        self.owner = owner
        self.holder = holder
        self.rank = rank
        self.peer = holder if rank == owner else owner
        self.timeout_s = timeout_s
        self._store = _own_client(store)
        self._prefix = f"{prefix}/{owner}-{holder}"
        self._me = 0 if rank == owner else 1
        self._pg: Any = None
        self._agreement = Rebuilds(self._store, self._prefix, me=self._me, timeout_s=timeout_s)
        self.rebuilds = 0

    @property
    def name(self) -> str:
        return f"{self.owner}->{self.holder}"

    @property
    def broken(self) -> bool:
        """Whether the next transfer must rebuild the group first."""
        return self._pg is None

    def connect(self, key: str) -> None:
        """Rendezvous with the peer under ``key`` and build a fresh group.

        Both endpoints must call it with the same ``key`` (the channel's first
        connect); returns once connected or raises ``ReplicationError`` after
        ``timeout_s``.
        """
        self.close()
        self._pg = self._group_on(PrefixStore(f"{self._prefix}/{key}/", self._store), None)

    def ensure(self, step: int) -> bool:
        """Rebuild the group if broken, for ``step``, on an attempt both endpoints joined.

        Returns whether it rebuilt. A connect that fails once both are there is
        retried within this call. Raises ``ReplicationError`` (the edge stays
        broken) when the peer does not come within ``timeout_s``, gave up this
        step's transfer, or every connect failed.
        """
        if not self.broken:
            return False
        at = (
            f"rank {self.rank}: connect replication edge {self.name} with peer {self.peer} "
            f"for step {step}"
        )
        try:
            self._pg = self._agreement.rebuild(
                step,
                lambda store: self._group_on(store, step),
                attempts=REPLICATION_REBUILD_ATTEMPTS,
            )
        except JoinTimeout as exc:
            raise ReplicationError(
                f"{at} failed: timed out (peer stalled, too slow, or not calling): {exc}"
            ) from None
        except PeerGaveUp as exc:
            raise ReplicationError(f"{at} failed: {exc}") from None
        except ConnectFailed as exc:
            raise ReplicationError(
                f"{at} failed {REPLICATION_REBUILD_ATTEMPTS} times although both endpoints "
                f"were there; {exc}"
            ) from exc
        except ReplicationError:
            raise
        except RuntimeError as exc:  # the job's store itself failed
            raise ReplicationError(f"{at} failed: the job's store failed: {exc}") from exc
        self.rebuilds += 1
        log.info(
            "rank %d: replication edge %s with peer %d rebuilt for step %d",
            self.rank,
            self.name,
            self.peer,
            step,
        )
        return True

    def give_up(self, step: int) -> None:
        """This endpoint's transfer for ``step`` failed for good: a peer that still
        comes to rebuild the edge for ``step`` is told at once (it would wait in vain)."""
        self._agreement.close(step)

    def _group_on(self, store: Store, step: int | None) -> Any:
        try:
            return dist.ProcessGroupGloo(store, self._me, 2, timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            at = "" if step is None else f" for step {step}"
            raise ReplicationError(
                f"rank {self.rank}: connect replication edge {self.name} with peer "
                f"{self.peer}{at} failed within {self.timeout_s:g} s: {describe_failure(exc)}"
            ) from exc

    def mark_broken(self) -> None:
        """Close the group now: the stream may hold messages nobody will consume.

        Dropping our reference is not enough: outstanding Gloo work objects keep
        the connection alive, and the peer would wait out its whole timeout. Gloo
        has no call to close a group's connections, but a wait that times out
        closes all of them ("Application timeout caused pair closure"), so post
        a receive on a tag the peer never sends and let it time out at once. The
        peer then sees a closed connection immediately.
        """
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            work = pg.recv([torch.empty(1, dtype=torch.uint8)], 1 - self._me, _CLOSE_TAG)
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the expected timeout, or the connection was already closed

    def close(self) -> None:
        """Release the group (its sockets close; pending operations fail)."""
        self._pg = None

    def post_send(self, tensor: torch.Tensor, tag: int) -> Any:
        """Start sending ``tensor`` (contiguous CPU) to the peer; returns the Gloo work."""
        return self._group().send([tensor], 1 - self._me, tag)

    def post_recv(self, tensor: torch.Tensor, tag: int) -> Any:
        """Start receiving into ``tensor`` (contiguous CPU) from the peer."""
        return self._group().recv([tensor], 1 - self._me, tag)

    def wait(self, work: Any) -> None:
        """Wait for ``work`` at most ``timeout_s``; raises Gloo's ``RuntimeError``."""
        work.wait(timedelta(seconds=self.timeout_s))

    def _group(self) -> Any:
        if self._pg is None:
            raise ReplicationError(
                f"rank {self.rank}: replication edge {self.name} with peer {self.peer} is "
                "not connected"
            )
        return self._pg


def _own_client(store: Store) -> Store:
    """A connection to ``store`` that this edge alone uses.

    A TCPStore client serves one request at a time, and a ``wait`` holds it until
    the key appears. The two edges of a rank rebuild at once on two threads; on a
    shared client one edge's wait (for the peer's address, or for the peer to
    arrive) kept the other edge from publishing its own, and the mirror image on
    the peer kept both waiting until the timeout (issue 20, item 1).
    """
    try:
        own: Store = store.clone()  # type: ignore[attr-defined]
        return own
    except (AttributeError, NotImplementedError, RuntimeError):
        return store  # a store type that cannot clone (e.g. a test's HashStore)


def describe_failure(exc: BaseException) -> str:
    """Gloo's message without its source-file prefix, with the likely reason named."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(" This is typically", 1)[0].rstrip(". ")
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return f"timed out (peer stalled, too slow, or not calling): {text}"
    if "closed" in lowered or "reset" in lowered or "broken pipe" in lowered:
        return f"connection lost (peer died or dropped the edge): {text}"
    return text

"""The control plane: a private CPU Gloo group for agreement collectives, every wait bounded.

GEMINI's small collectives (run identity, topology, availability, the
recovery step, walk-back decisions) must work whatever backend the job's own
group uses: on an NCCL default group a CPU tensor collective fails, and a
training group's timeout (often 30 minutes) is far too long for recovery. The
manager therefore creates one :class:`ControlPlane` (collective over its
group) and runs each agreement inside :meth:`ControlPlane.op`, which

* records that this rank arrived at the operation (one small key in the
  job's rendezvous store), then runs the collective on the private group,
  whose every wait is bounded by ``timeout_s``;
* on a failure (a timeout, or a peer that closed its connection) looks up
  which ranks never arrived and raises :class:`~lm_resiliency.errors.CollectiveTimeout`
  naming the operation, the bound and those ranks.

A Gloo group whose wait timed out is unusable afterwards; the manager fails
closed from then on (the job restarts and builds a new one).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.errors import CollectiveTimeout, ConfigError

_instances = itertools.count()


class ControlPlane:
    """Bounded agreement collectives over a private Gloo group of ``group``'s ranks.

    Collective: every rank of ``group`` constructs it at the same point (it
    creates a process group). Without an initialized default group it is a
    single-process plane whose collectives return at once.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"control_timeout_s={timeout_s!r} must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group: dist.ProcessGroup | None = None
        self.rank = 0
        self.world_size = 1
        self._store: Any = None
        self._seq = itertools.count()
        self._prefix = ""
        self.broken: str | None = None
        if not self.distributed:
            return
        parent = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        local = parent is not dist.group.WORLD
        self.group = dist.new_group(
            ranks,
            backend="gloo",
            timeout=timedelta(seconds=self.timeout_s),
            use_local_synchronization=local,
        )
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        with contextlib.suppress(Exception):  # naming absent ranks is best effort
            self._store = dist.distributed_c10d._get_default_store()
        # Keys of an earlier worker generation (same store) must never count as arrivals.
        nonce = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8).clone()
        with self.op("create the control plane"):
            dist.broadcast(nonce, src=ranks[0], group=self.group)
        self._prefix = f"lm_resiliency/control/{next(_instances)}/{bytes(nonce.tolist()).hex()}"

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        """Run the collective(s) in the ``with`` block as operation ``name``, bounded.

        Raises ``CollectiveTimeout`` naming ``name``, the bound and the ranks
        that never arrived when a collective inside fails or times out.
        """
        if self.broken is not None:
            raise CollectiveTimeout(
                f"rank {self.rank}: {name}: the control plane failed earlier ({self.broken}); "
                "restart the job"
            )
        key = None
        if self._store is not None and self._prefix:
            key = f"{self._prefix}/{next(self._seq)}"
            with contextlib.suppress(Exception):
                self._store.set(f"{key}/{self.rank}", b"1")
        try:
            yield
        except RuntimeError as exc:  # torch's distributed errors derive from RuntimeError
            missing = self._absent(key)
            who = (
                f"rank(s) {missing} never reached it"
                if missing
                else "every rank reached it (the collective itself failed)"
                if key is not None
                else "the absent ranks cannot be named (no rendezvous store)"
            )
            self.broken = f"{name} failed"
            raise CollectiveTimeout(
                f"rank {self.rank}: {name} did not complete within control_timeout_s="
                f"{self.timeout_s:g} s or lost a peer: {who}. Gloo said: {str(exc)[:300]}"
            ) from exc

    def _absent(self, key: str | None) -> list[int]:
        if key is None or self._store is None:
            return []
        missing = []
        for r in range(self.world_size):
            try:
                if not self._store.check([f"{key}/{r}"]):
                    missing.append(r)
            except Exception:
                return []
        return missing

    # -- small typed collectives ---------------------------------------------------

    def all_gather_bytes(self, data: bytes, *, name: str) -> list[bytes]:
        """Every rank's ``data``, in group-rank order."""
        if self.group is None:
            return [data]
        with self.op(name):
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.empty_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.group)
            width = max(1, *(int(s.item()) for s in sizes))
            mine = torch.zeros(width, dtype=torch.uint8)
            if data:
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(out, mine, group=self.group)
        return [bytes(t[: int(s.item())].tolist()) for t, s in zip(out, sizes, strict=True)]

    def any(self, flag: bool, *, name: str) -> bool:
        """Whether ``flag`` is true on any rank."""
        if self.group is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self.op(name):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def close(self) -> None:
        """Destroy the private group (call on every rank, or let the process end)."""
        if self.group is not None and self.broken is None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None

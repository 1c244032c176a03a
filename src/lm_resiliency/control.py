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

:meth:`ControlPlane.agree` is the one seam for "run this on every rank, and
fail on every rank alike if it failed anywhere" (setup steps, the fallback
step); :meth:`ControlPlane.gather_reasons` exchanges per-rank reason codes (the
recovery fetch rounds). :func:`all_gather_ints` and :func:`all_gather_trees`
are the front door's collectives on a caller-given group (the HSDP replica
group), on the device its backend needs, with no pickle.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lm_resiliency.errors import CollectiveTimeout, ConfigError, RankFailure, RankFailures
from lm_resiliency.state import decode_state, dumps_document, encode_state, loads_document

__all__ = ["ControlPlane", "all_gather_ints", "all_gather_trees"]

_instances = itertools.count()
_T = TypeVar("_T")


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

    def global_ranks(self) -> list[int]:
        """This plane's ranks in the job's (default group's) numbering, in group-rank order."""
        if self.group is None:
            return list(range(self.world_size))
        return [int(r) for r in dist.get_process_group_ranks(self.group)]

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

    def agree(self, fn: Callable[[], _T], name: str) -> _T:
        """Collective: run ``fn`` on every rank; if it raised on any rank, raise on every rank.

        Returns this rank's result when ``fn`` succeeded everywhere. Otherwise
        every rank raises the same :class:`~lm_resiliency.errors.RankFailures`
        (rank -> type, message and traceback; on the failing rank chained from
        its own exception), whose summary is ``"cannot <name> on rank(s) [..]"``.
        When every failure is a ``ConfigError`` (a bad setting or environment
        variable on one rank) every rank raises a ``ConfigError`` with that
        summary and each rank's error instead, chained from the ``RankFailures``.
        The outcomes travel over this plane, so a rank that never arrives is a
        ``CollectiveTimeout`` naming it, never an unbounded wait. A single-rank
        plane raises the error itself.
        """
        result: Any = None
        mine: Exception | None = None
        try:
            result = fn()
        except Exception as exc:
            mine = exc
        outcome = b""
        if mine is not None:
            f = RankFailure.from_exception(self.rank, mine)
            config = isinstance(mine, ConfigError)
            outcome = json.dumps([f.exc_type, f.message, f.traceback, config]).encode()
        failures: dict[int, RankFailure] = {}
        config_only = True
        for rank, blob in enumerate(self.all_gather_bytes(outcome, name=name)):
            if blob:
                exc_type, message, tb, config = json.loads(blob)
                failures[rank] = RankFailure(rank, exc_type, message, tb)
                config_only = config_only and bool(config)
        if not failures:
            return result  # type: ignore[no-any-return]
        if mine is not None and self.world_size == 1:
            raise mine  # nobody to agree with: the error itself
        summary = f"cannot {name} on rank(s) {sorted(failures)}"
        gathered = RankFailures(summary, failures)
        gathered.__cause__ = mine
        if config_only:
            lines = "; ".join(f"rank {r}: {f.exc_type}: {f.message}" for r, f in failures.items())
            raise ConfigError(f"{summary}: {lines}") from gathered
        raise gathered

    def gather_reasons(self, reasons: Sequence[str], *, name: str) -> list[tuple[str, ...]]:
        """Every rank's reason codes (``""``: no failure), in group-rank order.

        For exchanges that decide per rank instead of failing the job (the
        recovery fetch rounds: which source of which rank could not be opened).
        """
        blob = json.dumps(list(reasons)).encode()
        return [tuple(json.loads(b)) for b in self.all_gather_bytes(blob, name=name)]

    def all_gather_ints(self, value: int, *, name: str) -> list[int]:
        """Every rank's ``value``, in group-rank order."""
        if self.group is None:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.op(name):
            dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

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


# -- the front door's collectives on a caller-given group ---------------------------

_HEADER = 8  # bytes of the meta-length prefix of a packed tree


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(value: int, group: dist.ProcessGroup | None) -> list[int]:
    """Collective on ``group``: every rank's ``value``, in group-rank order."""
    device = _device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def _pack(tree: Any) -> torch.Tensor:
    enc = encode_state(tree)
    tensors = [t.detach().cpu().contiguous() for t in enc.tensors]
    meta = {
        "document": enc.document,
        "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for t in tensors],
    }  # fmt: skip
    meta_bytes = dumps_document(meta).encode("utf-8")
    parts = [
        torch.tensor(list(len(meta_bytes).to_bytes(_HEADER, "little")), dtype=torch.uint8),
        torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8),
        *[t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()],
    ]
    return torch.cat(parts)


def _unpack(buffer: torch.Tensor) -> Any:
    raw = buffer.cpu()
    n = int.from_bytes(bytes(raw[:_HEADER].tolist()), "little")
    meta = json.loads(bytes(raw[_HEADER : _HEADER + n].numpy()).decode("utf-8"))
    offset = _HEADER + n
    tensors = []
    for spec in meta["tensors"]:
        dtype = getattr(torch, spec["dtype"])
        shape = [int(s) for s in spec["shape"]]
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        chunk = raw[offset : offset + nbytes].clone()
        offset += nbytes
        tensors.append(chunk.view(dtype).reshape(shape))
    document = loads_document(dumps_document(meta["document"]))
    return decode_state(document, tensors)


def all_gather_trees(tree: Any, group: dist.ProcessGroup) -> list[Any]:
    """Collective on ``group``: every rank's state tree, in group-rank order.

    Two all-gathers (sizes, then the padded encodings). Raises
    ``StateEncodingError`` for an unsupported value (before any collective) and
    ``StateSchemaError`` when a peer's encoding does not validate.
    """
    device = _device(group)
    packed = _pack(tree)
    sizes = all_gather_ints(packed.numel(), group)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: packed.numel()] = packed.to(device)
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [_unpack(buf[:size]) for buf, size in zip(out, sizes, strict=True)]

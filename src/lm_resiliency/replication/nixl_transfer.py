"""NixlTransfer: one-sided reads of a served checkpoint from registered host memory.

With `NIXL <https://github.com/ai-dynamo/nixl>`_ installed (``pip install
nixl==1.5.1``), the rank that holds the state registers its arena with its NIXL
agent and publishes the agent's metadata, the arena's address and one CRC-32C
per chunk in the job's store; the destination reads the arena chunk by chunk
with NIXL READs that the source takes no part in (it may be busy, or stopped),
and checks every chunk's checksum.

Call order (the manager sends the same :class:`TransferKey` to both ranks)::

    # on both endpoints, once (creates this process's NIXL agent; no communication)
    nixl = NixlTransfer(run_id=run_id, timeout_s=30)
    # on rank key.src: register and publish; returns at once
    served = nixl.serve(key, layout=layout, state_document=doc, arena=arena)
    # on rank key.dst, any time after (waits up to timeout_s for the offer)
    received = nixl.fetch(key)
    # on rank key.src: wait for the destination's verdict, then release the memory
    served.wait(); served.close()

The arena must not change between ``serve`` and ``close``. What NIXL cannot
serve fails with :class:`~lm_resiliency.errors.TransferUnsupported` (NIXL not
installed, the backend plugin missing, state that is not host memory, a shard
on disk): the caller then chooses
:class:`~lm_resiliency.replication.torch_transfer.TorchTransfer` explicitly,
which needs both endpoints. There is no silent fallback.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from lm_resiliency.capture.arena import allocate_arena
from lm_resiliency.capture.layout import Layout
from lm_resiliency.checksums import ChunkCrc, arena_crcs, crc_count, mismatched
from lm_resiliency.errors import ConfigError, IntegrityError, ReplicationError, TransferUnsupported
from lm_resiliency.knobs import (
    CRC_CHUNK_BYTES,
    MAX_IN_FLIGHT_CHUNKS,
    REPLICATION_CHUNK_BYTES,
    REPLICATION_TIMEOUT_S,
)
from lm_resiliency.replication._protocol import Received
from lm_resiliency.replication.header import check_header, make_header
from lm_resiliency.replication.transfer import TransferKey, check_endpoint

_POLL_S = 0.0005
_instances = itertools.count()
_USE_TORCH = "use TorchTransfer (both endpoints take part) for this request"


def _import_nixl() -> Any:
    try:
        # optional dependency: imported only when a NIXL transfer is asked for
        from nixl._api import (  # noqa: PLC0415
            nixl_agent,
            nixl_agent_config,
        )
    except ImportError as exc:
        raise TransferUnsupported(
            f"NIXL is not available ({exc}); install it (pip install nixl==1.5.1) or {_USE_TORCH}"
        ) from exc
    return nixl_agent, nixl_agent_config


class NixlTransfer:
    """Keyed, checksummed, one-sided transfers over NIXL (one agent per instance).

    ``chunk_bytes`` is the size of one READ and the CRC-32C granularity (unless
    recorded checksums are served); ``max_in_flight`` READs are outstanding;
    ``timeout_s`` bounds every wait (the offer's arrival, each chunk, the
    destination's verdict). Raises ``TransferUnsupported`` when NIXL or its
    ``backend`` plugin is missing.
    """

    def __init__(
        self,
        *,
        run_id: str,
        rank: int | None = None,
        store: Store | None = None,
        chunk_bytes: int = REPLICATION_CHUNK_BYTES,
        timeout_s: float = REPLICATION_TIMEOUT_S,
        max_in_flight: int = MAX_IN_FLIGHT_CHUNKS,
        backend: str = "UCX",
        namespace: str = "lm_resiliency/nixl",
    ) -> None:
        for name, value in (("chunk_bytes", chunk_bytes), ("max_in_flight", max_in_flight)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"NixlTransfer {name}={value!r} must be a positive integer")
        if not timeout_s > 0:
            raise ConfigError(f"NixlTransfer timeout_s={timeout_s!r} must be > 0")
        if not isinstance(run_id, str) or not run_id:
            raise ConfigError(f"NixlTransfer run_id={run_id!r} must be a non-empty string")
        nixl_agent, nixl_agent_config = _import_nixl()
        if rank is None or store is None:
            if not dist.is_initialized():
                raise ConfigError(
                    "NixlTransfer needs rank= and store= when torch.distributed is not initialized"
                )
            rank = dist.get_rank() if rank is None else rank
            store = dist.distributed_c10d._get_default_store() if store is None else store
        self.rank = rank
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        self.max_in_flight = max_in_flight
        self.timeout_s = float(timeout_s)
        self._store = store
        self._namespace = namespace
        self._abandoned: list[torch.Tensor] = []  # arenas of failed reads (see _read)
        self.agent_name = f"lmr-{run_id}-rank{rank}-{os.getpid()}-{next(_instances)}"
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(backends=[backend]))
        if backend not in self._agent.backends:
            raise TransferUnsupported(
                f"NIXL backend {backend!r} is not available here (plugins: "
                f"{sorted(self._agent.plugin_list)}); choose another backend= or {_USE_TORCH}"
            )

    def serve(
        self,
        key: TransferKey,
        *,
        layout: Layout,
        state_document: dict[str, Any],
        arena: torch.Tensor,
        slot_crcs: tuple[int, ...] | None = None,
    ) -> NixlServed:
        """Offer ``arena`` (the state for ``key.dst``) for one-sided reads; on rank ``key.src``.

        Registers the arena with NIXL and publishes the offer; returns at once.
        ``slot_crcs`` (per ``knobs.CRC_CHUNK_BYTES``, recorded when the arena was
        filled) are served instead of checksums computed now, so damage since then
        is caught by the reader. Raises ``TransferUnsupported`` for an arena NIXL
        cannot serve from host memory, ``ValueError`` when key and arena disagree.
        """
        check_endpoint(self.rank, key, key.src, "serve", "fetch")
        if not isinstance(arena, torch.Tensor) or arena.device.type != "cpu":
            where = arena.device if isinstance(arena, torch.Tensor) else type(arena).__name__
            raise TransferUnsupported(
                f"transfer {key.describe}: NIXL serves registered host memory only, and this "
                f"state is on {where}; copy it into a host arena, or {_USE_TORCH} (it also "
                "streams a shard file chunk by chunk)"
            )
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise ValueError(
                f"transfer {key.describe}: arena must be a contiguous flat uint8 tensor, got "
                f"{arena.dtype} {tuple(arena.shape)}"
            )
        if key.layout_digest != layout.digest or key.total_bytes != arena.numel():
            raise ValueError(f"transfer {key.describe}: key does not describe the arena served")
        if slot_crcs is not None:
            crc_chunk, crcs = CRC_CHUNK_BYTES, list(slot_crcs)
        else:
            crc_chunk, crcs = self.chunk_bytes, list(arena_crcs(arena, self.chunk_bytes))
        header = make_header(self.run_id, key.dst, key.step, layout, state_document)
        try:
            registered = self._agent.register_memory(arena)
            metadata = self._agent.get_agent_metadata()
        except Exception as exc:  # nixl's binding errors have no common base class
            raise TransferUnsupported(
                f"transfer {key.describe}: NIXL could not register the arena: {exc}; {_USE_TORCH}"
            ) from exc
        offer = {
            "transfer": key.to_json(),
            "header": header,
            "agent": self.agent_name,
            "address": arena.data_ptr(),
            "crc_chunk_bytes": crc_chunk,
            "crcs": crcs,
        }
        prefix = self._prefix(key)
        self._store.set(f"{prefix}/metadata", metadata)
        self._store.set(f"{prefix}/offer", json.dumps(offer))  # last: readers wait for it
        return NixlServed(self, key, prefix, registered, arena)

    def fetch(self, key: TransferKey) -> Received:
        """Read the state ``key`` names from rank ``key.src``'s registered memory; on ``key.dst``.

        Waits up to ``timeout_s`` for the offer, refuses one whose key differs
        before reading any byte, reads ``chunk_bytes`` at a time (each READ
        bounded by ``timeout_s``) and checks every chunk's CRC-32C. The source's
        :meth:`NixlServed.wait` learns the outcome. Raises ``ReplicationError``
        (no offer, key mismatch, a read failed or timed out) or ``IntegrityError``.
        """
        check_endpoint(self.rank, key, key.dst, "fetch", "serve")
        prefix = self._prefix(key)
        at = f"rank {self.rank}: fetch of transfer {key.describe} from peer {key.src}"
        try:
            self._store.wait([f"{prefix}/offer"], timedelta(seconds=self.timeout_s))
        except RuntimeError:
            raise ReplicationError(
                f"{at} failed: peer {key.src} served nothing within {self.timeout_s:g} s "
                "(not serving this key, stalled, or gone)"
            ) from None
        try:
            received = self._read(key, prefix, at)
        except BaseException as exc:
            self._store.set(f"{prefix}/done", f"failed: {type(exc).__name__}: {exc}")
            raise
        self._store.set(f"{prefix}/done", "ok")
        return received

    def _read(self, key: TransferKey, prefix: str, at: str) -> Received:
        offer = json.loads(bytes(self._store.get(f"{prefix}/offer")).decode("utf-8"))
        if offer.get("transfer") != key.to_json():
            raise ReplicationError(
                f"{at} failed: transfer key mismatch: expected {key.to_json()}, peer {key.src} "
                f"serves {offer.get('transfer')}; give both endpoints the same TransferKey"
            )
        header = offer["header"]
        layout = check_header(header, run_id=self.run_id, owner_rank=key.dst, step=key.step)
        crc_chunk, crcs = offer["crc_chunk_bytes"], offer["crcs"]
        if len(crcs) != crc_count(key.total_bytes, crc_chunk):
            raise ReplicationError(f"{at} failed: the offer's checksums do not cover the arena")
        arena = allocate_arena(key.total_bytes, pin=False)
        agent = self._agent
        try:
            remote = agent.add_remote_agent(self._store.get(f"{prefix}/metadata"))
            local = agent.register_memory(arena)
        except Exception as exc:
            raise ReplicationError(f"{at} failed: NIXL could not connect: {exc}") from exc
        running = ChunkCrc(crc_chunk, key.total_bytes)
        try:
            self._read_chunks(arena, int(offer["address"]), remote, running, at)
        except BaseException:
            # A READ may still be in flight into the arena: never free or deregister it.
            self._abandoned.append(arena)
            raise
        agent.deregister_memory(local)
        agent.remove_remote_agent(remote)
        bad = mismatched(running.digests(), crcs)
        if bad:
            raise IntegrityError(
                f"transfer {key.describe} from rank {key.src}: chunk(s) {bad} of {len(crcs)} "
                "failed their CRC-32C check; the received state was discarded"
            )
        return Received(key.dst, key.step, header, layout, arena)

    def _read_chunks(
        self, arena: torch.Tensor, address: int, remote: str, running: ChunkCrc, at: str
    ) -> None:
        agent = self._agent
        total = arena.numel()
        chunks = [(o, min(self.chunk_bytes, total - o)) for o in range(0, total, self.chunk_bytes)]
        pending: deque[tuple[Any, int, int, int]] = deque()
        base = arena.data_ptr()

        def post(index: int, offset: int, nbytes: int) -> None:
            what = f"read chunk {index + 1}/{len(chunks)}"
            try:
                mine = agent.get_xfer_descs([(base + offset, nbytes, 0)], "DRAM")
                theirs = agent.get_xfer_descs([(address + offset, nbytes, 0)], "DRAM")
                handle = agent.initialize_xfer("READ", mine, theirs, remote)
                state = agent.transfer(handle)
            except Exception as exc:
                raise ReplicationError(f"{at} failed: {what}: {exc}") from exc
            if state == "ERR":
                agent.release_xfer_handle(handle)
                raise ReplicationError(f"{at} failed: {what}: NIXL reported an error")
            pending.append((handle, index, offset, nbytes))

        def retire() -> None:
            handle, index, offset, nbytes = pending.popleft()
            what = f"read chunk {index + 1}/{len(chunks)}"
            deadline = time.monotonic() + self.timeout_s
            try:
                while (state := agent.check_xfer_state(handle)) == "PROC":
                    if time.monotonic() > deadline:
                        raise ReplicationError(
                            f"{at} failed: {what} not done within {self.timeout_s:g} s "
                            f"(peer's memory unreachable)"
                        )
                    time.sleep(_POLL_S)
                if state != "DONE":
                    raise ReplicationError(f"{at} failed: {what}: NIXL state {state}")
            finally:
                agent.release_xfer_handle(handle)
            running.update(arena[offset : offset + nbytes].numpy())

        try:
            for index, (offset, nbytes) in enumerate(chunks):
                if len(pending) >= self.max_in_flight:
                    retire()
                post(index, offset, nbytes)
            while pending:
                retire()
        finally:
            # After a failure the posted READs are left to NIXL (releasing an in-flight
            # handle is refused); _read keeps their destination alive.
            pending.clear()

    def _prefix(self, key: TransferKey) -> str:
        return f"{self._namespace}/{self.run_id}/{key.name}/step-{key.step}/{key.src}-{key.dst}"


class NixlServed:
    """An arena offered for one-sided reads; keep it unchanged until :meth:`close`."""

    def __init__(
        self, owner: NixlTransfer, key: TransferKey, prefix: str, registered: Any, arena: Any
    ) -> None:
        self.key = key
        self._owner = owner
        self._prefix = prefix
        self._registered = registered
        self._arena = arena

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the destination's verdict (default bound: the transfer's ``timeout_s``).

        Returns when it read and verified every chunk; raises ``ReplicationError``
        with its reason when it failed, or naming the peer when it reported nothing.
        """
        bound = self._owner.timeout_s if timeout_s is None else timeout_s
        key = self.key
        store = self._owner._store
        try:
            store.wait([f"{self._prefix}/done"], timedelta(seconds=bound))
        except RuntimeError:
            raise ReplicationError(
                f"rank {key.src}: transfer {key.describe}: peer {key.dst} reported no fetch "
                f"within {bound:g} s (not fetching, stalled, or gone)"
            ) from None
        verdict = bytes(store.get(f"{self._prefix}/done")).decode("utf-8")
        if verdict != "ok":
            raise ReplicationError(
                f"rank {key.src}: transfer {key.describe}: peer {key.dst} {verdict}"
            )

    def close(self) -> None:
        """Deregister the arena; reads of it fail from now on."""
        if self._registered is not None:
            self._owner._agent.deregister_memory(self._registered)
            self._registered = None

    def __enter__(self) -> NixlServed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

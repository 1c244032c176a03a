"""``SidecarStore``: one rank's trust record on node-local disk, beside its shards.

The status sidecar (``status-rank-<R>.json``, see :mod:`lm_resiliency.persistence.sidecar`)
says which steps this rank persisted, its candidate, its recovery-verified
history, SCOUT's rejections and verdict; a small trust marker
(:func:`~lm_resiliency.persistence.namespace.trust_marker_file`) next to a verified
shard keeps that verdict when the sidecar is damaged. :class:`ShardStore` owns
one ``SidecarStore`` (``store.sidecar``) and shares its lock with it, so a shard's
publication, its record in the sidecar and retention stay one critical section.

Call order: ``load(topo_fd, trust_of)`` once (a damaged sidecar is rebuilt from
the shards' own metadata and markers) -> ``mark_candidate`` / ``mark_verified`` /
``mark_rejected`` / ``set_verdict`` as validation decides; ``read_status(rank)``
reads any rank's sidecar on this node. No call is collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from lm_resiliency._safefs import (
    entry_kind,
    open_file_nofollow,
    open_subdir,
    opened_dir,
    pread_exact,
)
from lm_resiliency.errors import ConfigError, SidecarUnavailable, UnsafePathError
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.publish import publish_bytes
from lm_resiliency.persistence.sidecar import SidecarStatus, read_status, write_status
from lm_resiliency.persistence.trust import RecoveryVerdict, TrustStatus

log = logging.getLogger(__name__)

__all__ = ["MAX_CATALOG_BYTES", "SidecarStore", "has_marker"]

#: Bound on a saved SCOUT catalog (signatures of shapes, never tensors).
MAX_CATALOG_BYTES = 4 << 20


class SidecarStore:
    """This rank's status sidecar and trust markers in one run and topology folder.

    ``root`` and ``parts`` name the topology folder (as :class:`ShardStore` opens
    it); ``lock`` is the shard store's, held around every sidecar write.
    """

    def __init__(
        self,
        root: Path,
        parts: tuple[str, ...],
        *,
        run_id: str,
        topology: str,
        rank: int,
        history_limit: int,
        retry_s: float,
        lock: threading.Lock,
    ) -> None:
        self._root = root
        self._parts = parts
        self._topology_path = root.joinpath(*parts)
        self.run_id = run_id
        self.topology = topology
        self.rank = rank
        self.history_limit = history_limit
        self.retry_s = retry_s
        self._lock = lock
        self._status = SidecarStatus(run_id=run_id, topology=topology, rank=rank)

    def load(self, topo_fd: int, trust_of: Callable[[int, int], TrustStatus | None]) -> None:
        """Read this rank's sidecar; a damaged one is rebuilt from the shards and replaced.

        ``trust_of(owner_rank, step)`` is the trust recorded in a shard's header.
        """
        try:
            loaded = self._read(topo_fd, self.rank)
        except SidecarUnavailable as exc:
            loaded = self._rebuild(topo_fd, trust_of)
            log.warning(
                "%s; rebuilt it from the shards' own metadata (verified steps %s)",
                exc,
                list(loaded.verified_history),
            )
            write_status(topo_fd, loaded)
        if loaded is not None:
            self._status = loaded

    def status(self) -> SidecarStatus:
        """This rank's current trust record (as last published). Never waits on a write."""
        return self._status

    def record_persisted(self, topo_fd: int, owner_rank: int, step: int) -> None:
        """Record a published shard of ``owner_rank`` at ``step`` (call with the lock held)."""
        self._status = self._status.with_persisted(owner_rank, step)
        write_status(topo_fd, self._status)

    def mark_candidate(self, step: int) -> SidecarStatus:
        """Record ``step`` as this rank's candidate and publish the sidecar."""
        return self._update(lambda s: s.with_candidate(_nonneg(step)))

    def mark_verified(self, step: int, owners: tuple[int, ...] = ()) -> SidecarStatus:
        """Add ``step`` to this rank's recovery-verified history and publish the sidecar.

        For each of ``owners`` whose shard of ``step`` is on this node a small
        trust marker is published next to it, so the verdict survives a damaged
        sidecar (retention and a rebuilt sidecar read it back).
        """
        limit = self.history_limit
        status = self._update(lambda s: s.with_verified(_nonneg(step), history_limit=limit))
        for owner in owners:
            self._write_marker(step, owner)
        return status

    def mark_rejected(self, step: int, reason: str) -> SidecarStatus:
        """Record ``step`` as rejected (by SCOUT) with ``reason`` and publish the sidecar.

        The step leaves the verified history and stops being the candidate; its
        trust markers are removed, so a rebuilt sidecar cannot bring it back.
        """
        limit = self.history_limit
        status = self._update(
            lambda s: s.with_rejected(_nonneg(step), str(reason), history_limit=limit)
        )
        self._drop_markers(step)
        return status

    def set_verdict(self, verdict: RecoveryVerdict | None) -> SidecarStatus:
        """Publish SCOUT's recovery verdict in the sidecar (``None`` clears it)."""
        return self._update(lambda s: s.with_verdict(verdict))

    def write_catalog(self, body: bytes) -> None:
        """Atomically replace this rank's saved SCOUT catalog (``scout-catalog-rank-<R>.json``)."""
        if len(body) > MAX_CATALOG_BYTES:
            raise ValueError(
                f"a SCOUT catalog of {len(body)} bytes exceeds {MAX_CATALOG_BYTES}; it holds "
                "shapes only, so this is a bug"
            )
        with self._lock, opened_dir(self._root, self._parts, create=True) as topo_fd:
            publish_bytes(topo_fd, ns.catalog_file(self.rank), body)

    def read_catalog(self) -> bytes | None:
        """The bytes of this rank's saved SCOUT catalog, ``None`` when there is none.

        Never follows a link; raises ``UnsafePathError`` for an entry that is not a
        regular file of ours and ``ValueError`` for one larger than the bound.
        """
        name = ns.catalog_file(self.rank)
        try:
            with opened_dir(self._root, self._parts, create=False) as topo_fd:
                fd = open_file_nofollow(
                    topo_fd, name, os.O_RDONLY, where=str(self._topology_path / name)
                )
        except FileNotFoundError:
            return None
        try:
            raw = pread_exact(fd, MAX_CATALOG_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(raw) > MAX_CATALOG_BYTES:
            raise ValueError(
                f"{self._topology_path / name} is larger than {MAX_CATALOG_BYTES} bytes: not "
                "a SCOUT catalog"
            )
        return raw

    def read_status(self, rank: int) -> SidecarStatus | None:
        """Read ``rank``'s sidecar from this node's disk (``None`` if it has none).

        Retries visibility failures for ``retry_s``; raises ``SidecarUnavailable``
        for a persistently malformed file or any identity, schema or trust mismatch.
        """
        try:
            with opened_dir(self._root, self._parts, create=False) as topo_fd:
                return self._read(topo_fd, rank)
        except FileNotFoundError:
            return None

    def _update(self, change: Callable[[SidecarStatus], SidecarStatus]) -> SidecarStatus:
        with self._lock, opened_dir(self._root, self._parts, create=True) as topo_fd:
            new = change(self._status)
            write_status(topo_fd, new)
            self._status = new
            return new

    def _read(self, topo_fd: int, rank: int) -> SidecarStatus | None:
        return read_status(
            topo_fd,
            run_id=self.run_id,
            topology=self.topology,
            rank=rank,
            where=str(self._topology_path / ns.sidecar_file(rank)),
            retry_s=self.retry_s,
        )

    def _write_marker(self, step: int, owner_rank: int) -> None:
        try:
            with opened_dir(self._root, (*self._parts, ns.step_dir(step)), create=False) as d:
                if entry_kind(d, ns.shard_file(owner_rank)) != "file":
                    return
                body = json.dumps(
                    {
                        "kind": ns.TRUST_MARKER_KIND,
                        "run_id": self.run_id,
                        "topology": self.topology,
                        "owner_rank": owner_rank,
                        "step": step,
                        "trust": TrustStatus.RECOVERY_VERIFIED.value,
                    }
                ).encode()
                publish_bytes(d, ns.trust_marker_file(owner_rank), body)
        except (FileNotFoundError, UnsafePathError):
            return

    def _drop_markers(self, step: int) -> None:
        try:
            with opened_dir(self._root, (*self._parts, ns.step_dir(step)), create=False) as d:
                for name in os.listdir(d):
                    owner = ns.parse_trust_marker_file(name)
                    if owner is not None and name == ns.trust_marker_file(owner):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=d)
        except (FileNotFoundError, UnsafePathError):
            return

    def _rebuild(
        self, topo_fd: int, trust_of: Callable[[int, int], TrustStatus | None]
    ) -> SidecarStatus:
        """This rank's trust record rebuilt from the shards on this node (damaged sidecar).

        A step counts as verified when its shard says so or carries a trust
        marker; persisted steps are the newest shard of each owner.
        """
        owners: dict[int, list[int]] = {}
        for name in os.listdir(topo_fd):
            step = ns.parse_step_dir(name)
            if step is None or entry_kind(topo_fd, name) != "dir":
                continue
            with contextlib.suppress(FileNotFoundError, UnsafePathError, OSError):
                step_fd = open_subdir(topo_fd, name, create=False, where=name)
                try:
                    for entry in os.listdir(step_fd):
                        owner = ns.parse_shard_file(entry)
                        if owner is not None:
                            owners.setdefault(owner, []).append(step)
                finally:
                    os.close(step_fd)
        status = SidecarStatus(run_id=self.run_id, topology=self.topology, rank=self.rank)
        verified = sorted(
            s
            for s in owners.get(self.rank, [])
            if trust_of(self.rank, s) is TrustStatus.RECOVERY_VERIFIED
            or has_marker(topo_fd, s, self.rank)
        )
        for step in verified[-self.history_limit :]:
            status = status.with_verified(step, history_limit=self.history_limit)
        for owner, steps in owners.items():
            status = status.with_persisted(owner, max(steps))
        # What else the sidecar said (SCOUT's rejections and verdict) is unknown now: stay
        # conservative until a verified recovery is certified again.
        return status.with_verdict(
            RecoveryVerdict(
                step=max(verified, default=0),
                reason="the status sidecar was damaged and rebuilt from the shards; what SCOUT "
                "recorded in it is unknown, so recovery stays in verified mode",
            )
        )


def has_marker(topo_fd: int, step: int, owner_rank: int) -> bool:
    """Whether ``owner_rank``'s shard of ``step`` carries a trust marker."""
    try:
        d = open_subdir(topo_fd, ns.step_dir(step), create=False, where=ns.step_dir(step))
    except (FileNotFoundError, UnsafePathError):
        return False
    try:
        return entry_kind(d, ns.trust_marker_file(owner_rank)) == "file"
    finally:
        os.close(d)


def _nonneg(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step={step!r} must be an int >= 0")
    return step

"""``ShardStore``: one rank's view of the node-local persistence tier.

Call order (one store per rank, every rank of a node may share ``disk_folder``):
construct with the agreed ``run_id`` and job topology fingerprint (see
:mod:`lm_resiliency.persistence.identity`) -> ``write`` completed slots (own
state and the peer replicas this rank holds, each under its owner's rank) ->
``sidecar.mark_candidate`` / ``mark_verified`` / ``mark_rejected`` / ``set_verdict``
as validation decides (the trust record: :mod:`lm_resiliency.persistence.sidecar_store`)
-> at recovery
``steps`` and ``read`` -> ``close``. No call is collective.

Thread safety: ``write`` may run on a background flush thread while a signal
flush writes from another thread; temp names are unique per call and the
sidecar, retention and spare pool are guarded by locks. A shard is published
*before* any lock is taken, so a signal-time flush that finds the lock held by
the interrupted thread still leaves its shard on disk (only the sidecar update
and retention wait).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_resiliency._safefs import (
    entry_kind,
    judge,
    open_file_nofollow,
    open_subdir,
    opened_dir,
)
from lm_resiliency.capture import Layout
from lm_resiliency.errors import ConfigError, ShardUnavailable, UnsafePathError
from lm_resiliency.knobs import CRC_CHUNK_BYTES, SIDECAR_RETRY_S
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.document import ShardIdentity, check_identity
from lm_resiliency.persistence.format import (
    ShardHeader,
    read_header,
    write_shard,
)
from lm_resiliency.persistence.lineage import Lineage, lineage_file, read_lineage, write_lineage
from lm_resiliency.persistence.publish import Recycled, publish, reap_stale_temps
from lm_resiliency.persistence.reader import ShardReader
from lm_resiliency.persistence.reasons import UnavailableReason, unavailable
from lm_resiliency.persistence.retention import (
    SparePool,
    newest_verified,
    pending_candidates,
    plan_retention,
)
from lm_resiliency.persistence.sidecar import DEFAULT_HISTORY_LIMIT
from lm_resiliency.persistence.sidecar_store import SidecarStore, has_marker
from lm_resiliency.persistence.trust import TrustStatus

log = logging.getLogger(__name__)
_R = UnavailableReason


@dataclass(frozen=True)
class LoadedShard:
    """A fully validated shard: nothing here was returned before every check passed."""

    layout: Layout
    arena: torch.Tensor
    """Flat ``uint8`` tensor of ``layout.total_bytes``; ``layout.views(arena)`` are the tensors."""
    state_document: dict[str, Any]
    trust: TrustStatus
    path: Path
    owner_rank: int
    step: int


def _nonneg(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an int >= 0")
    return value


def open_shard(
    dir_fd: int,
    owner_rank: int,
    path: Path,
    expected: ShardIdentity | None,
    *,
    verify_integrity: bool,
) -> tuple[int, ShardHeader]:
    """Open ``path``'s shard in ``dir_fd`` and validate its header (identity when given).

    Returns the open descriptor (the caller closes it) and the header.
    Raises ``ShardUnavailable`` with the precise reason.
    """
    try:
        fd = open_file_nofollow(dir_fd, ns.shard_file(owner_rank), os.O_RDONLY, where=str(path))
    except FileNotFoundError:
        raise unavailable(_R.MISSING, path, "no such file") from None
    except UnsafePathError as exc:
        raise _refused(path, exc) from None
    try:
        header = read_header(fd, path, file_bytes=os.fstat(fd).st_size)
        if expected is not None:
            check_identity(header.doc.identity, expected, path)
        if verify_integrity and header.doc.integrity is None:
            raise unavailable(
                _R.CHECKSUM_MISSING,
                path,
                "written without checksums but verify_integrity=True; it becomes eligible "
                "only once a checksummed generation is persisted",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, header


_UNSAFE_REASONS = {
    "symlink": _R.SYMLINK,
    "foreign_owner": _R.FOREIGN_OWNER,
    "writable_by_others": _R.WRITABLE_BY_OTHERS,
}


def _refused(path: Path, exc: UnsafePathError) -> ShardUnavailable:
    return unavailable(_UNSAFE_REASONS.get(exc.reason, _R.NOT_A_FILE), path, str(exc))


class ShardStore:
    """Format-v3 shards and their retention for one rank under ``disk_folder``.

    The rank's trust record (status sidecar and trust markers) is ``sidecar``.

    ``topology`` is the job-wide topology fingerprint; ``rank`` the rank whose
    sidecar this store owns. Raises ``ConfigError`` for invalid arguments,
    ``UnsafePathError`` if a namespace directory is a symlink and
    ``IdentityMismatch`` if the namespace's manifests name another run or
    topology. A damaged own sidecar is logged and replaced at the next mark
    (its history is dropped, which only narrows what counts as verified).
    """

    def __init__(
        self,
        disk_folder: str | Path,
        *,
        run_id: str,
        topology: str,
        rank: int,
        verify_integrity: bool,
        keep_generations: int = 2,
        chunk_bytes: int = CRC_CHUNK_BYTES,
        history_limit: int = DEFAULT_HISTORY_LIMIT,
        sidecar_retry_s: float = SIDECAR_RETRY_S,
        recycle_files: bool = True,
    ) -> None:
        for name, value in (("run_id", run_id), ("topology", topology)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name}={value!r} must be a non-empty string")
        self.rank = _nonneg("rank", rank)
        if _nonneg("keep_generations", keep_generations) < 1:
            raise ConfigError(f"keep_generations={keep_generations} must be >= 1 (default 2)")
        if _nonneg("chunk_bytes", chunk_bytes) == 0 or _nonneg("history_limit", history_limit) == 0:
            raise ConfigError(
                f"chunk_bytes={chunk_bytes} and history_limit={history_limit} must be >= 1"
            )
        self.run_id = run_id
        self.topology = topology
        self.verify_integrity = bool(verify_integrity)
        self.keep_generations = keep_generations
        self.chunk_bytes = chunk_bytes
        self.history_limit = history_limit
        self.sidecar_retry_s = sidecar_retry_s
        root = Path(disk_folder)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Links *above* the folder are the user's choice; none is followed below it.
        self.root = root.resolve(strict=True)
        self._parts = (ns.run_dir(run_id), ns.topology_dir(topology))
        self.topology_path = self.root.joinpath(*self._parts)
        self._lock = threading.Lock()
        self._spares = SparePool() if recycle_files else None
        self._trust_cache: dict[tuple[int, int], TrustStatus] = {}
        self._reported: set[tuple[int, int, str]] = set()  # (step, owner, why) warned
        self._timeline_cache: dict[tuple[int, int], str | None] = {}
        self.lineage = Lineage()
        self.timeline: str | None = None
        """Timeline recorded in every shard this store writes (set by the manager)."""
        with opened_dir(self.root, self._parts[:1], create=True) as run_fd:
            ns.ensure_run_manifest(run_fd, run_id, where=str(self.root / self._parts[0]))
            reap_stale_temps(run_fd)
        self.sidecar = SidecarStore(
            self.root,
            self._parts,
            run_id=run_id,
            topology=topology,
            rank=self.rank,
            history_limit=history_limit,
            retry_s=sidecar_retry_s,
            lock=self._lock,
        )
        """This rank's status sidecar and trust markers (:class:`SidecarStore`)."""
        with opened_dir(self.root, self._parts, create=True) as topo_fd:
            ns.ensure_topology_manifest(topo_fd, topology, where=str(self.topology_path))
            reap_stale_temps(topo_fd)
            self.sidecar.load(topo_fd, self._trust)
        self._finalizer = weakref.finalize(self, _drop_spares, self.root, self._parts, self._spares)

    # -- paths -----------------------------------------------------------------

    def path_for(self, owner_rank: int, step: int) -> Path:
        """Where ``owner_rank``'s shard of ``step`` is published."""
        return self.topology_path / ns.step_dir(step) / ns.shard_file(owner_rank)

    def _identity(self, owner_rank: int, step: int) -> ShardIdentity:
        return ShardIdentity(
            self.run_id, self.topology, _nonneg("owner_rank", owner_rank), _nonneg("step", step)
        )

    # -- writing -----------------------------------------------------------------

    def write(
        self,
        *,
        owner_rank: int,
        step: int,
        layout: Layout,
        arena: torch.Tensor,
        state_document: dict[str, Any],
        trust: TrustStatus = TrustStatus.UNVERIFIED,
    ) -> Path:
        """Publish ``owner_rank``'s state of ``step`` atomically; return the final path.

        ``arena`` is the slot's flat ``uint8`` CPU buffer described by
        ``layout``; ``state_document`` the JSON non-tensor state (stored
        verbatim). Peer replicas are written with the peer's ``owner_rank``.
        Before writing, stale temps of this shard left by dead writers of our
        scope are removed; after publishing, the sidecar records the step and
        retention runs for this owner. Raises ``StateEncodingError`` (dtype or
        state not storable; nothing written), ``UnsafePathError`` or
        ``OSError`` (the previous content of the shard, if any, is unchanged).
        """
        ident = self._identity(owner_rank, step)
        want_bytes = layout.total_bytes
        timeline = self.timeline

        def _write(fd: int) -> int:
            return write_shard(
                fd,
                identity=ident,
                layout=layout,
                arena=arena,
                state_document=state_document,
                trust=TrustStatus(trust),
                integrity=self.verify_integrity,
                chunk_bytes=self.chunk_bytes,
                timeline=timeline,
            )

        with opened_dir(self.root, self._parts, create=True) as topo_fd:
            for attempt in range(2):
                step_fd = open_subdir(
                    topo_fd,
                    ns.step_dir(step),
                    create=True,
                    where=str(self.path_for(0, step).parent),
                )
                try:
                    reap_stale_temps(step_fd, target=ns.shard_file(owner_rank))
                    self._publish(topo_fd, step_fd, owner_rank, want_bytes, _write)
                    break
                except FileNotFoundError:
                    # Another rank's retention removed this (old) step directory
                    # between our mkdir and our temp file; make it again once.
                    if attempt:
                        raise
                finally:
                    os.close(step_fd)
            with self._lock:
                self._trust_cache[(owner_rank, step)] = TrustStatus(trust)
                self._timeline_cache[(owner_rank, step)] = timeline
                self.sidecar.record_persisted(topo_fd, owner_rank, step)
                self._retain(topo_fd, owner_rank)
        return self.path_for(owner_rank, step)

    def _publish(
        self,
        topo_fd: int,
        step_fd: int,
        owner_rank: int,
        want_bytes: int,
        write: Callable[[int], int],
    ) -> None:
        name = ns.shard_file(owner_rank)
        spare = self._spares.take(want_bytes) if self._spares is not None else None
        if spare is not None:
            try:
                publish(step_fd, name, write, recycle=Recycled(topo_fd, spare.name, spare.identity))
                return
            except FileNotFoundError:
                log.debug("spare %s vanished; writing a new file", spare.name)
        publish(step_fd, name, write)

    # -- retention ---------------------------------------------------------------

    def _retain(self, topo_fd: int, owner_rank: int) -> None:
        """Retire this owner's generations that the lineage superseded, then all but the newest
        ``keep_generations`` (and the newest verified, and every candidate newer than it)
        of those on the current history.

        A generation of a timeline the lineage does not know (another job's) is
        never deleted; neither is the newest verified generation on the history.
        """
        steps = self._steps_in(topo_fd, owner_rank)
        status = self.sidecar.status()
        history = set(status.verified_history)
        lineage = self.lineage
        current: list[int] = []
        for step in steps:
            timeline = self._timeline_of(owner_rank, step)
            if lineage.superseded(step, timeline):
                self._retire(topo_fd, owner_rank, step)
            elif lineage.eligible(step, timeline):
                current.append(step)

        def verified(step: int) -> bool:
            return (
                step in history
                or self._trust(owner_rank, step) is TrustStatus.RECOVERY_VERIFIED
                or has_marker(topo_fd, step, owner_rank)
            )

        keep_verified = newest_verified(current, verified)
        rejected = {s for s, _ in status.rejected}

        def candidate(step: int) -> bool:  # written as a candidate, neither promoted nor rejected
            trust = self._trust(owner_rank, step)
            return trust is TrustStatus.CANDIDATE and step not in rejected and not verified(step)

        for step in plan_retention(
            current,
            keep=self.keep_generations,
            verified_step=keep_verified,
            candidates=pending_candidates(current, keep_verified, candidate),
        ):
            self._retire(topo_fd, owner_rank, step)

    def _trust(self, owner_rank: int, step: int) -> TrustStatus | None:
        if (owner_rank, step) not in self._trust_cache:
            self._read_facts(owner_rank, step)
        return self._trust_cache.get((owner_rank, step))

    def _timeline_of(self, owner_rank: int, step: int) -> str | None:
        if (owner_rank, step) not in self._timeline_cache:
            self._read_facts(owner_rank, step)
        return self._timeline_cache.get((owner_rank, step))

    def timeline_of(self, owner_rank: int, step: int) -> str | None:
        """The timeline recorded in ``owner_rank``'s shard of ``step`` (``None``: unrecorded
        or unreadable; reading it fully validates later)."""
        return self._timeline_of(owner_rank, step)

    def _read_facts(self, owner_rank: int, step: int) -> None:
        path = self.path_for(owner_rank, step)
        try:
            with opened_dir(self.root, (*self._parts, ns.step_dir(step)), create=False) as d:
                fd, header = open_shard(d, owner_rank, path, None, verify_integrity=False)
                os.close(fd)
        except (OSError, ShardUnavailable, UnsafePathError):
            return
        self._trust_cache[(owner_rank, step)] = header.doc.trust
        self._timeline_cache[(owner_rank, step)] = header.doc.timeline

    def _retire(self, topo_fd: int, owner_rank: int, step: int) -> None:
        name, dname = ns.shard_file(owner_rank), ns.step_dir(step)
        self._trust_cache.pop((owner_rank, step), None)
        self._timeline_cache.pop((owner_rank, step), None)
        try:
            step_fd = open_subdir(topo_fd, dname, create=False, where=dname)
        except (FileNotFoundError, UnsafePathError):
            return
        try:
            where = str(self.path_for(owner_rank, step))
            if entry_kind(step_fd, name) == "file" and not (
                self._spares is not None and self._spares.park(step_fd, name, topo_fd, where=where)
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=step_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ns.trust_marker_file(owner_rank), dir_fd=step_fd)
            os.fsync(step_fd)
        finally:
            os.close(step_fd)
        with contextlib.suppress(OSError):  # not empty: another owner's shard or a foreign temp
            os.rmdir(dname, dir_fd=topo_fd)
        os.fsync(topo_fd)

    # -- reading -----------------------------------------------------------------

    def read(self, *, owner_rank: int, step: int, into: torch.Tensor | None = None) -> LoadedShard:
        """Load and validate ``owner_rank``'s shard of ``step``.

        Checks, before returning anything: no symlink on the way, header size
        limits, JSON schema, format version 3, identity (run_id, topology,
        owner rank, step), tensor table vs layout, file size, and every CRC
        (a missing CRC with ``verify_integrity`` makes the shard unavailable).
        ``into`` (a flat ``uint8`` CPU tensor large enough) receives the bytes
        instead of a fresh tensor; after a failure its content is garbage.
        Raises ``ShardUnavailable`` (or its integrity / identity subclasses)
        naming the reason.
        """
        with self.open_reader(owner_rank=owner_rank, step=step) as reader:
            try:
                arena = reader.read_all(into)
            except OSError as exc:
                raise unavailable(
                    _R.IO_ERROR, reader.path, f"reading its data failed: {exc}"
                ) from None
            doc = reader.header.doc
            path = reader.path
            return LoadedShard(doc.layout, arena, doc.state, doc.trust, path, owner_rank, step)

    def open_reader(self, *, owner_rank: int, step: int) -> ShardReader:
        """Open ``owner_rank``'s shard of ``step`` with every check of :meth:`read`
        but the data CRCs; the caller reads the data (and closes the reader).

        Raises ``ShardUnavailable`` naming the reason.
        """
        expected = self._identity(owner_rank, step)
        path = self.path_for(owner_rank, step)
        try:
            with opened_dir(self.root, (*self._parts, ns.step_dir(step)), create=False) as d:
                fd, header = open_shard(
                    d, owner_rank, path, expected, verify_integrity=self.verify_integrity
                )
        except FileNotFoundError:
            raise unavailable(_R.MISSING, path, "its step directory does not exist") from None
        except UnsafePathError as exc:
            raise _refused(path, exc) from None
        except OSError as exc:
            raise unavailable(_R.IO_ERROR, path, f"reading it failed: {exc}") from None
        return ShardReader(fd, header, path, owner_rank, step)

    def steps(self, owner_rank: int) -> list[int]:
        """Steps with a published shard of ``owner_rank`` in this run and topology, ascending.

        Listing only: a listed step may still fail :meth:`read`'s validation.
        Nothing unsafe is listed (a symlink, a FIFO, an entry of another user or
        writable by others); an unsafe run or topology folder lists nothing and
        is logged once as a warning naming it.
        """
        try:
            with opened_dir(self.root, self._parts, create=False) as topo_fd:
                return self._steps_in(topo_fd, owner_rank)
        except FileNotFoundError:
            return []
        except UnsafePathError as exc:
            if (-1, owner_rank, exc.path) not in self._reported:
                self._reported.add((-1, owner_rank, exc.path))
                log.warning("rank %d: no step of this folder is used: %s", self.rank, exc)
            return []

    def _steps_in(self, topo_fd: int, owner_rank: int) -> list[int]:
        found = []
        for name in os.listdir(topo_fd):
            step = ns.parse_step_dir(name)
            if step is None or entry_kind(topo_fd, name) != "dir":
                continue
            shard_name = f"{name}/{ns.shard_file(owner_rank)}"
            try:
                step_st = os.stat(name, dir_fd=topo_fd, follow_symlinks=False)
                shard = os.stat(shard_name, dir_fd=topo_fd, follow_symlinks=False)
            except OSError:
                continue
            # Only a regular file of ours in a directory of ours counts: a link, a FIFO or
            # an entry another user planted is never offered to recovery.
            where = str(self.topology_path / shard_name)
            problem = judge(step_st, str(self.topology_path / name), expect="dir") or judge(
                shard, where, expect="file"
            )
            if problem is None:
                found.append(step)
            elif (step, owner_rank, problem.reason) not in self._reported:
                self._reported.add((step, owner_rank, problem.reason))  # once, not per write
                log.warning("rank %d: step %d is not used: %s", self.rank, step, problem)
        return sorted(found)

    def set_lineage(self, lineage: Lineage, timeline: str | None) -> None:
        """Adopt the job's lineage and the timeline to record in new shards; publish it here."""
        with self._lock:
            self.lineage, self.timeline = lineage, timeline
            with opened_dir(self.root, self._parts, create=True) as topo_fd:
                write_lineage(
                    topo_fd, lineage_file(self.rank), lineage, run_id=self.run_id, rank=self.rank
                )

    def read_lineage(self) -> Lineage | None:
        """This rank's lineage file on this node, if any (``None`` when absent or damaged)."""
        try:
            with opened_dir(self.root, self._parts, create=False) as topo_fd:
                where = str(self.topology_path / lineage_file(self.rank))
                return read_lineage(
                    topo_fd, lineage_file(self.rank), run_id=self.run_id, where=where
                )
        except (FileNotFoundError, UnsafePathError):
            return None

    # -- housekeeping --------------------------------------------------------------

    def reap_stale_temps(self) -> int:
        """Remove temps of dead writers of our scope in this run's folders; return the count."""
        removed = 0
        with opened_dir(self.root, self._parts[:1], create=True) as run_fd:
            removed += reap_stale_temps(run_fd)
        with opened_dir(self.root, self._parts, create=True) as topo_fd:
            removed += reap_stale_temps(topo_fd)
            for name in os.listdir(topo_fd):
                if ns.parse_step_dir(name) is None or entry_kind(topo_fd, name) != "dir":
                    continue
                with contextlib.suppress(FileNotFoundError, UnsafePathError):
                    step_fd = open_subdir(topo_fd, name, create=False, where=name)
                    try:
                        removed += reap_stale_temps(step_fd)
                    finally:
                        os.close(step_fd)
        return removed

    def close(self) -> None:
        """Delete parked spare files. The store must not be used afterwards."""
        self._finalizer()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_spares(root: Path, parts: tuple[str, ...], spares: SparePool | None) -> None:
    if spares is None or not spares.names:
        return
    with contextlib.suppress(OSError), opened_dir(root, parts, create=False) as topo_fd:
        spares.drop_all(topo_fd)

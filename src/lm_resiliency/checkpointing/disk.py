"""This rank's node-local shard store, opened on first use under the run's disk lock.

:class:`LocalDisk` never creates the disk folder just to look (:meth:`existing`
returns ``None`` while the run has no namespace there); :meth:`store` creates
the store and takes this rank's disk lock of the run (``live-rank-<R>.lock``,
see :mod:`lm_resiliency.persistence.disk_lock`). Parts that must see the store
once it exists (the timeline history publishes its lineage there) subscribe
with :meth:`when_open`, called at once when it is already open.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.persistence import ShardStore
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.disk_lock import DiskLock

__all__ = ["LocalDisk"]


class LocalDisk:
    """Lazy access to one rank's :class:`ShardStore`; see the module docstring."""

    def __init__(self, config: InMemoryCkptConfig, *, run_id: str, topology: str, rank: int):
        self._config = config
        self._run_id = run_id
        self._topology = topology
        self._rank = rank
        self._lock = threading.Lock()
        self._store: ShardStore | None = None
        self._disk_lock: DiskLock | None = None
        self._on_open: list[Callable[[ShardStore], None]] = []

    def exists(self) -> bool:
        """Whether this run's namespace exists in ``disk_folder`` (never created to look)."""
        return (Path(self._config.disk_folder) / ns.run_dir(self._run_id)).is_dir()

    def store(self) -> ShardStore:
        """The store, created (and the disk lock taken) on first use.

        Raises ``ResiliencyError`` naming the other job when a live one holds the lock.
        """
        with self._lock:
            if self._store is None:
                cfg = self._config
                store = ShardStore(
                    cfg.disk_folder,
                    run_id=self._run_id,
                    topology=self._topology,
                    rank=self._rank,
                    verify_integrity=cfg.verify_integrity,
                    keep_generations=cfg.keep_generations,
                )
                try:
                    lock = DiskLock.take(store.root, run_id=self._run_id, rank=self._rank)
                except BaseException:
                    store.close()
                    raise
                self._store, self._disk_lock = store, lock
                for fn in self._on_open:
                    fn(store)
            return self._store

    def existing(self) -> ShardStore | None:
        """The store when the run has files on this disk (opening it then), else ``None``."""
        if self._store is not None or self.exists():
            return self.store()
        return None

    def when_open(self, fn: Callable[[ShardStore], None]) -> None:
        """Call ``fn(store)`` once the store exists (now, if it does)."""
        with self._lock:
            self._on_open.append(fn)
            opened = self._store
        if opened is not None:
            fn(opened)

    def release(self) -> None:
        """Release the disk lock (at exit: the store's files stay for the restarted worker)."""
        if self._disk_lock is not None:
            self._disk_lock.release()

    def close(self) -> None:
        """Close the store and release the disk lock."""
        if self._store is not None:
            self._store.close()
        self.release()

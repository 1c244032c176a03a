"""A background writer for trust records (SCOUT's certifications), never on the step's path.

``submit(job, what)`` queues a sidecar or shard update on one worker thread
and returns at once; ``wait(timeout_s)`` blocks until everything submitted so
far is written. A failed write is logged and never stops training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger(__name__)


class TrustWriter:
    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmr-trust")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], object], what: str) -> None:
        def run() -> None:
            try:
                job()
            except Exception as exc:
                log.warning("rank %d: writing trust record (%s) failed: %s", self._rank, what, exc)
                raise

        with self._lock:
            self._pending.append(self._pool.submit(run))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every update submitted so far is written; ``False`` on timeout."""
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for job in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job.result(timeout=left)
            except FutureTimeout:
                return False
            except Exception:  # logged by the job itself
                continue
        with self._lock:
            self._pending = [j for j in self._pending if not j.done()]
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)

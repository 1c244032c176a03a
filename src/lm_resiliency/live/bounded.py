"""Store requests to the live coordinator that return within a bound (docs/live-membership.md §2.5).

A c10d request to a coordinator that is alive but stopped (SIGSTOP, a wedged host) never
returns, whatever the store's timeout (measured on torch 2.13: ``check``, ``get``, ``add``,
``compare_set`` all hang). :class:`Requester` runs requests on one daemon thread with its own
client and lets the caller wait at most a bound; :class:`BoundedStore` is a ``dist.Store``
whose every request goes through one, so that what is handed to other code (the heal's
transfers, Gloo's rendezvous of a cross-replica group) cannot hang on the coordinator either.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar, cast

import torch.distributed as dist

from lm_resiliency.live.lease import StoreErrors, brief
from lm_resiliency.live.view import CoordinatorLost

__all__ = ["BoundedStore", "Requester"]

_T = TypeVar("_T")


class Requester:
    """One daemon thread that runs the caller's store requests on its own client.

    The caller waits for the answer at most ``timeout_s`` (``TimeoutError``); a request that
    does not return leaves this thread stuck, and every later request times out too.
    """

    def __init__(self, factory: Callable[[], dist.Store], name: str) -> None:
        self._factory = factory
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, request: Callable[[dist.Store], _T], timeout_s: float) -> _T:
        item = _Request(request)
        self._queue.put(item)
        if not item.done.wait(timeout_s):
            raise TimeoutError(f"a store request did not return within {timeout_s:g} s")
        if item.error is not None:
            raise item.error
        return cast(_T, item.value)

    def ask(
        self,
        request: Callable[[dist.Store], _T],
        timeout_s: float,
        *,
        address: str,
        who: str,
        then: str,
        on_lost: Callable[[str], None] | None = None,
    ) -> _T:
        """:meth:`call`, with a silent or unreachable coordinator raised as ``CoordinatorLost``
        (``"<who>: coordinator <address> silent (...); <then>"``) after ``on_lost(why)``."""
        try:
            return self.call(request, timeout_s)
        except TimeoutError as exc:
            why, cause = f"coordinator {address} silent ({exc})", None
        except StoreErrors as exc:
            why, cause = f"coordinator {address} unreachable ({brief(exc)})", exc
        if on_lost is not None:
            on_lost(why)
        raise CoordinatorLost(f"{who}: {why}; {then}") from cause

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        store: dist.Store | None = None
        while (item := self._queue.get()) is not None:
            try:
                store = store or self._factory()
                item.value = item.fn(store)
            except BaseException as exc:  # handed to the caller's thread
                item.error = exc
            item.done.set()


class _Request:
    def __init__(self, fn: Callable[[dist.Store], object]) -> None:
        self.fn = fn
        self.value: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class BoundedStore(dist.Store):
    """A client of the coordinator's store whose every request returns or raises in time.

    Each request may take the store's own timeout (a ``get`` or ``wait`` blocks until the key
    exists or that timeout passes) plus ``slack_s`` (``coordinator_timeout_s``); past that
    the coordinator is taken as silent: ``on_lost(why)`` is called and ``CoordinatorLost``
    raised, naming the address. Other errors (a dead coordinator's connection reset, a key
    that never came) are raised as the store raised them. ``clone()`` gives a new client
    (its own connection and thread), kept alive until this one is closed.
    """

    def __init__(
        self,
        factory: Callable[[], dist.Store],
        *,
        address: str,
        timeout_s: float,
        slack_s: float,
        on_lost: Callable[[str], None] | None = None,
        name: str = "lmr-live-store",
    ) -> None:
        super().__init__()
        self._factory = factory
        self._address = address
        self._timeout_s = timeout_s
        self._slack_s = slack_s
        self._on_lost = on_lost
        self._name = name
        self._requests = Requester(factory, name)
        self._clones: list[BoundedStore] = []
        """Kept alive: a ``PrefixStore`` or a process group over a clone holds only its C++
        side, and a Python store whose Python object is gone answers "Not implemented"."""

    # -- dist.Store ----------------------------------------------------------------------

    def set(self, key: str, value: str) -> None:
        self._call(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda s: s.get(key))

    def add(self, key: str, value: int) -> int:
        return self._call(lambda s: s.add(key, value))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self._call(lambda s: s.compare_set(key, expected_value, desired_value))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda s: s.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._call(lambda s: s.wait(keys))
        else:
            self._call(lambda s: s.wait(keys, timeout), timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        return self._call(lambda s: s.delete_key(key))

    def num_keys(self) -> int:
        return self._call(lambda s: s.num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda s: s.multi_get(keys))

    def set_timeout(self, timeout: timedelta) -> None:
        self._call(lambda s: s.set_timeout(timeout))
        self._timeout_s = timeout.total_seconds()

    def clone(self) -> BoundedStore:
        clone = BoundedStore(
            self._factory,
            address=self._address,
            timeout_s=self._timeout_s,
            slack_s=self._slack_s,
            on_lost=self._on_lost,
            name=self._name,
        )
        self._clones.append(clone)
        return clone

    def close(self) -> None:
        """Stop the request threads of this client and its clones (a stuck one stays, as a
        daemon)."""
        self._requests.close()
        for clone in self._clones:
            clone.close()

    # -- internals -----------------------------------------------------------------------

    def _call(self, request: Callable[[dist.Store], _T], timeout_s: float | None = None) -> _T:
        bound = (self._timeout_s if timeout_s is None else timeout_s) + self._slack_s
        try:
            return self._requests.call(request, bound)
        except TimeoutError:
            why = (
                f"coordinator {self._address} silent (a store request did not return within "
                f"{bound:g} s)"
            )
            if self._on_lost is not None:
                self._on_lost(why)
            raise CoordinatorLost(
                f"live membership: {why}; it is stopped (SIGSTOP) or its host is wedged. Check "
                f"the coordinator process at {self._address} (lm-resiliency coordinator, or the "
                "launcher's); falling back to whole-job restart with memory recovery"
            ) from None

"""The liveness socket: a death is seen at once, as EOF (docs/live-membership.md §2.3).

Every worker keeps one TCP connection to the coordinator's liveness port and sends one hello
line (``{"replica", "group_rank", "inc", "pid"}``) on it, then nothing. The kernel closes the
connection when the process dies, however it dies, so the coordinator sees EOF without waiting
for a lease. The other way round, the worker sees EOF when the coordinator dies.

The coordinator also sends bytes the other way (:meth:`LivenessServer.poke`): one when it has
something for that process to read. Members are poked when their epoch fails, so they read
the failure flag only then (:meth:`LivenessClient.take_pokes`, a non-blocking ``select``)
instead of with a store request at every collective; a warm spare (replica ``-1``, group rank
its spare id) waits on the socket for its assignment (docs/live-membership.md §6.3).

:class:`LivenessServer` is polled by the coordinator's decision loop (``poll`` doubles as the
loop's sleep, so an EOF wakes it at once); :class:`LivenessClient` is owned by one worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass

__all__ = ["Gone", "Hello", "LivenessClient", "LivenessServer"]

_log = logging.getLogger(__name__)
_MAX_HELLO_BYTES = 4096


@dataclass(frozen=True)
class Hello:
    """A worker connected and named itself."""

    replica: int
    group_rank: int
    inc: str
    pid: int
    t: float
    """``time.monotonic()`` on the coordinator when the hello was read."""


@dataclass(frozen=True)
class Gone:
    """The connection of a worker that said hello was closed (EOF or reset): it died."""

    replica: int
    group_rank: int
    inc: str
    pid: int
    t: float


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.hello: Hello | None = None


class LivenessServer:
    """The coordinator's side: a listening socket and its connections, one thread (the loop)."""

    def __init__(self, host: str = "") -> None:
        self._listener = socket.create_server((host, 0), backlog=1024)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._by_inc: dict[str, _Conn] = {}

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def poll(self, timeout_s: float) -> list[Hello | Gone]:
        """Wait up to ``timeout_s`` for activity; return the hellos and deaths seen, in order."""
        events: list[Hello | Gone] = []
        for key, _ in self._selector.select(timeout=max(0.0, timeout_s)):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data, events)
        return events

    def poke(self, inc: str) -> bool:
        """Send one byte to the connection of incarnation ``inc`` (a warm spare); False when
        it is gone. Never blocks: a spare that does not read has at most a few bytes queued."""
        conn = self._by_inc.get(inc)
        if conn is None:
            return False
        try:
            conn.sock.send(b"!")
        except (BlockingIOError, InterruptedError):
            return True  # its buffer is full of earlier pokes: it has one to read
        except OSError:
            return False
        return True

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn, events: list[Hello | Gone]) -> None:
        try:
            data = conn.sock.recv(_MAX_HELLO_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # a reset is a death too
        if not data:
            self._drop(conn)
            if conn.hello is not None:
                h = conn.hello
                events.append(Gone(h.replica, h.group_rank, h.inc, h.pid, time.monotonic()))
            return
        if conn.hello is not None:
            return  # nothing is expected after the hello; ignore it
        conn.buf += data
        if b"\n" not in conn.buf:
            if len(conn.buf) > _MAX_HELLO_BYTES:
                _log.warning("liveness: a connection sent no hello line; closed")
                self._drop(conn)
            return
        line = conn.buf.split(b"\n", 1)[0]
        try:
            doc = json.loads(line)
            conn.hello = Hello(
                replica=_int(doc["replica"]),
                group_rank=_int(doc["group_rank"]),
                inc=str(doc["inc"]),
                pid=_int(doc["pid"]),
                t=time.monotonic(),
            )
        except (ValueError, KeyError, TypeError) as exc:
            _log.warning("liveness: malformed hello %r (%s); connection closed", line[:200], exc)
            self._drop(conn)
            return
        self._by_inc[conn.hello.inc] = conn
        events.append(conn.hello)

    def _drop(self, conn: _Conn) -> None:
        if conn.hello is not None and self._by_inc.get(conn.hello.inc) is conn:
            del self._by_inc[conn.hello.inc]
        self._selector.unregister(conn.sock)
        conn.sock.close()


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an int")
    return value


class LivenessClient:
    """A worker's connection to the coordinator's liveness port (owned by one thread)."""

    def __init__(
        self, host: str, port: int, *, replica: int, group_rank: int, inc: str, timeout_s: float
    ) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        hello = {"replica": replica, "group_rank": group_rank, "inc": inc, "pid": os.getpid()}
        self._sock.sendall(json.dumps(hello).encode() + b"\n")
        self._sock.setblocking(False)
        self._closed = False
        self._lock = threading.Lock()
        self._poked = False
        self._eof = False

    def _drain(self, timeout_s: float = 0.0) -> None:
        """Read what the coordinator sent (pokes) and whether it closed; under the lock."""
        if self._closed or self._eof:
            return
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout_s))
        while readable:
            try:
                data = self._sock.recv(_MAX_HELLO_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._eof = True  # a reset is the coordinator gone too
                return
            if not data:
                self._eof = True
                return
            self._poked = True
            readable, _, _ = select.select([self._sock], [], [], 0)

    def closed_by_peer(self) -> bool:
        """Whether the coordinator closed the connection (it died or shut down). Never blocks."""
        with self._lock:
            self._drain()
            return self._closed or self._eof

    def take_pokes(self) -> bool:
        """Whether the coordinator poked this process since the last call (never blocks).
        Thread-safe: one caller sees each poke."""
        with self._lock:
            self._drain()
            poked, self._poked = self._poked, False
            return poked

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a poke; True when one (or more) came, and they are
        read. Raises ``ConnectionError`` when the coordinator closed the connection."""
        if self._closed:
            raise ConnectionError("the liveness connection is closed")
        with self._lock:
            self._drain(timeout_s)
            poked, self._poked = self._poked, False
            if self._eof:
                raise ConnectionError("the live coordinator closed the liveness connection")
            return poked

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

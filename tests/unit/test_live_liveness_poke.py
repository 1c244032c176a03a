"""The liveness socket's second use: the coordinator pokes a waiting warm spare, which costs
no store request while it waits (docs/live-membership.md §6.3). Real sockets on loopback."""

from __future__ import annotations

import time

import pytest

from lm_resiliency.live.liveness import Gone, Hello, LivenessClient, LivenessServer


def _hello(server: LivenessServer, timeout_s: float = 5.0) -> list[Hello | Gone]:
    deadline = time.monotonic() + timeout_s
    events: list[Hello | Gone] = []
    while not events and time.monotonic() < deadline:
        events = server.poll(0.05)
    return events


def test_a_poke_wakes_the_spare_and_is_read_once() -> None:
    server = LivenessServer("127.0.0.1")
    client = LivenessClient("127.0.0.1", server.port, replica=-1, group_rank=3, inc="s" * 32,
                            timeout_s=5.0)  # fmt: skip
    try:
        (hello,) = _hello(server)
        assert isinstance(hello, Hello) and (hello.replica, hello.group_rank) == (-1, 3)
        assert client.wait(0.05) is False  # nothing sent: times out
        assert server.poke("s" * 32) and server.poke("s" * 32)
        assert client.wait(5.0) is True  # both pokes read at once
        assert client.wait(0.05) is False
        assert not client.closed_by_peer()
        assert server.poke("unknown") is False
    finally:
        client.close()
        server.close()


def test_a_spare_sees_the_coordinator_close_and_the_coordinator_sees_the_spare_go() -> None:
    server = LivenessServer("127.0.0.1")
    client = LivenessClient("127.0.0.1", server.port, replica=-1, group_rank=0, inc="t" * 32,
                            timeout_s=5.0)  # fmt: skip
    _hello(server)
    client.close()
    (gone,) = _hello(server)
    assert isinstance(gone, Gone) and gone.inc == "t" * 32
    assert server.poke("t" * 32) is False  # its connection is dropped
    other = LivenessClient("127.0.0.1", server.port, replica=-1, group_rank=1, inc="u" * 32,
                           timeout_s=5.0)  # fmt: skip
    _hello(server)
    server.close()
    with pytest.raises(ConnectionError, match="closed the liveness connection"):
        other.wait(5.0)
    other.close()


def test_a_member_sees_each_poke_once_and_still_sees_the_coordinator_close() -> None:
    # A member reads the failure flag only when poked; the heartbeat thread's check for EOF
    # must not hide a poke (it used to peek), and a pending poke must not hide the EOF.
    server = LivenessServer("127.0.0.1")
    client = LivenessClient("127.0.0.1", server.port, replica=0, group_rank=0, inc="m" * 32,
                            timeout_s=5.0)  # fmt: skip
    try:
        _hello(server)
        assert client.take_pokes() is False
        assert server.poke("m" * 32)
        deadline = time.monotonic() + 5.0
        while not client.closed_by_peer() and time.monotonic() < deadline:
            if client.take_pokes():  # the EOF check drained it; the poke is kept for this
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the poke was never seen")
        assert client.take_pokes() is False  # seen once
        server.poke("m" * 32)
        server.close()
        deadline = time.monotonic() + 5.0
        while not client.closed_by_peer():
            assert time.monotonic() < deadline, "the coordinator's close was never seen"
            time.sleep(0.01)
        assert client.take_pokes() is True  # the poke before the close is not lost either
    finally:
        client.close()

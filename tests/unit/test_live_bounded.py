"""Requests to the live coordinator return within a bound, and a lost coordinator is named.

Real c10d stores on loopback: a coordinator that is silent (a request that does not return in
time) and one that is unreachable (nothing listens on its port) both become
``CoordinatorLost`` through ``Requester.ask``, which the membership and the warm spare share.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lm_resiliency.live.bounded import Requester
from lm_resiliency.live.view import CoordinatorLost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_answer_is_returned() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server.set("k", "v")
    port = server.port
    requests = Requester(lambda: dist.TCPStore("127.0.0.1", port, is_master=False), "t-ok")
    try:
        got = requests.ask(lambda s: s.get("k"), 5.0, address="a", who="w", then="t")
        assert got == b"v"
    finally:
        requests.close()


def test_a_silent_coordinator_is_lost_within_the_bound() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    requests = Requester(lambda: dist.TCPStore("127.0.0.1", port, is_master=False), "t-silent")
    seen: list[str] = []
    address = f"127.0.0.1:{port}"
    try:
        # A key that never comes: the request blocks far past the caller's bound.
        start = time.monotonic()
        with pytest.raises(CoordinatorLost) as info:
            requests.ask(
                lambda s: s.wait(["never"], timedelta(seconds=30)),
                0.5,
                address=address,
                who="live spare",
                then="the warm spare stops",
                on_lost=seen.append,
            )
        assert time.monotonic() - start < 5.0
    finally:
        requests.close()
        server.set("never", "1")  # releases the stuck request thread
    text = str(info.value)
    assert text.startswith(f"live spare: coordinator {address} silent (")
    assert text.endswith("; the warm spare stops")
    assert seen == [text.removeprefix("live spare: ").removesuffix("; the warm spare stops")]


def test_an_unreachable_coordinator_is_lost_with_its_cause() -> None:
    port = _free_port()
    requests = Requester(
        lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1)),
        "t-unreachable",
    )
    address = f"127.0.0.1:{port}"
    try:
        with pytest.raises(CoordinatorLost) as info:
            requests.ask(
                lambda s: s.get("k"),
                10.0,
                address=address,
                who="live membership",
                then="falling back to whole-job restart with memory recovery",
            )
    finally:
        requests.close()
    assert str(info.value).startswith(f"live membership: coordinator {address} unreachable (")
    assert info.value.__cause__ is not None

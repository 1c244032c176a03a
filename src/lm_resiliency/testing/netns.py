"""Simulated nodes on one machine: Linux network namespaces joined by a private bridge.

For node-loss tests and demos. Each simulated node is a network namespace with
one interface ``eth0`` holding ``10.200.0.<i+1>/24``; the interfaces are veth
pairs whose other ends sit on a bridge inside a separate "hub" namespace. The
subnet exists only inside these namespaces: nothing is configured in the
machine's own namespace, so the traffic never leaves the machine and parallel
test runs (each with its own hub) cannot collide even with the same addresses.

Run a process "on" a node with ``node.command_prefix`` (``ip netns exec <ns>``)
and ``node.env`` (``GLOO_SOCKET_IFNAME=eth0``, so Gloo binds the node's address
and not whatever the shared hostname resolves to). Launch torchrun with
``--local-addr=node.address`` for the same reason. :meth:`NetnsNode.kill_all`
SIGKILLs every process in the node, which is what losing the node looks like to
the rest of the job.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool from iproute2;
:func:`netns_available` says whether this machine qualifies and why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["NetnsNode", "netns_available", "node_namespaces", "two_node_namespaces"]

_SUBNET = "10.200.0"
_IFNAME = "eth0"
_IP_TIMEOUT_S = 30.0
_MAX_NODES = 200

_available: tuple[bool, str] | None = None


@dataclass(frozen=True)
class NetnsNode:
    """One simulated node: a network namespace with one address on the private subnet."""

    index: int
    namespace: str
    address: str
    ifname: str = _IFNAME

    @property
    def command_prefix(self) -> tuple[str, ...]:
        """Prefix for a command that must run inside this node's namespace."""
        return ("ip", "netns", "exec", self.namespace)

    @property
    def env(self) -> dict[str, str]:
        """Environment for processes on this node (Gloo binds the node's interface)."""
        return {"GLOO_SOCKET_IFNAME": self.ifname}

    def pids(self) -> list[int]:
        """Ids of every process currently running in this node's namespace."""
        out = _ip("netns", "pids", self.namespace)
        return [int(p) for p in out.split()]

    def kill_all(self, timeout_s: float = 30.0) -> list[int]:
        """SIGKILL every process in the node and wait until none is left; return their ids.

        Processes that start while this runs (a dying agent's children) are
        killed too. Raises ``TimeoutError`` naming the survivors if the namespace
        is not empty after ``timeout_s``.
        """
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"node {self.namespace}: processes {pids} still alive {timeout_s:.0f}s "
                    "after SIGKILL (uninterruptible sleep?)"
                )
            # Killed processes leave the namespace once their parent reaps them.
            time.sleep(0.05)


def netns_available() -> tuple[bool, str]:
    """Whether simulated nodes can be created here, and if not, why (for ``pytest.skip``).

    Checks for root and the ``ip`` tool, then creates and deletes a probe
    namespace with a veth pair and a bridge, since containers can lack the
    capabilities even as root. The answer is cached for the process.
    """
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return False, "the `ip` tool is missing; install iproute2 (apt-get install -y iproute2)"
    try:
        with node_namespaces(1):
            pass
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return False, f"cannot create a network namespace with a veth pair here: {detail.strip()}"
    return True, "network namespaces available"


@contextlib.contextmanager
def node_namespaces(n: int) -> Iterator[list[NetnsNode]]:
    """Create ``n`` simulated nodes on one private bridge; always tear them down.

    Yields the nodes in index order (addresses ``10.200.0.1``, ``.2``, ...).
    Namespace names are unique per call. On exit every process left in the
    namespaces is killed and the namespaces are deleted (their veths with
    them), even when the body or the setup raised. Raises
    ``subprocess.CalledProcessError`` when a setup step fails.
    """
    if not 1 <= n <= _MAX_NODES:
        raise ValueError(f"n={n} simulated nodes is out of range; use 1..{_MAX_NODES}")
    tag = f"lmr-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    hub = f"{tag}-hub"
    nodes = [NetnsNode(i, f"{tag}-n{i}", f"{_SUBNET}.{i + 1}") for i in range(n)]
    created: list[str] = []
    try:
        for name in (hub, *(node.namespace for node in nodes)):
            _ip("netns", "add", name)
            created.append(name)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for node in nodes:
            port = f"v{node.index}"
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", node.ifname,
                "netns", node.namespace)  # fmt: skip
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.namespace, "link", "set", node.ifname, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        yield nodes
    finally:
        for node in nodes:
            if node.namespace in created:
                with contextlib.suppress(Exception):
                    node.kill_all(timeout_s=10.0)
        for name in reversed(created):
            with contextlib.suppress(Exception):
                _ip("netns", "delete", name)


@contextlib.contextmanager
def two_node_namespaces() -> Iterator[tuple[NetnsNode, NetnsNode]]:
    """Two simulated nodes, A (``10.200.0.1``) and B (``10.200.0.2``).

    See :func:`node_namespaces` for what is created and the cleanup guarantee.
    """
    with node_namespaces(2) as (a, b):
        yield a, b


def _ip(*args: str) -> str:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=True
    )
    return result.stdout

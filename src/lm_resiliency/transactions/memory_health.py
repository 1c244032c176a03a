"""Memory headroom of this rank, for the MTGS vote (``MTGSConfig.min_memory_headroom``).

* On a CUDA device: free over total device memory (``torch.cuda.mem_get_info``, a
  driver query, no stream synchronisation).
* On CPU: one minus the process's resident set size over the memory limit of its
  cgroup, read from the kernel's files: ``/proc/self/cgroup`` names the cgroup,
  ``/proc/self/mountinfo`` where its hierarchy is mounted, and the limit is the
  smallest ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1) of that
  cgroup and its ancestors. No limit (``max``, or v1's "unlimited" page-rounded
  2^63) means no headroom to measure: the rank never votes on it.
  ``MTGSConfig.memory_limit_bytes`` replaces the cgroup's limit (a host whose
  limit is enforced elsewhere, or a test).

A rank below the threshold votes ``LOW_MEMORY`` just before its synchronised
backward pass (the forward's activations are alive then), so the step is aborted
on every rank before any update, and retried after the allocator's cache is freed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Headroom", "cgroup_memory_limit", "headroom", "process_rss_bytes"]

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Headroom:
    """What this rank uses of what it may use."""

    where: str
    """``"cuda:N"`` or ``"cpu"`` (process RSS against the cgroup or configured limit)."""
    used_bytes: int
    limit_bytes: int

    @property
    def fraction(self) -> float:
        """The free share of the limit (negative when the limit is already exceeded)."""
        return 1.0 - self.used_bytes / self.limit_bytes

    def describe(self) -> str:
        return (
            f"{self.where}: {self.used_bytes / 2**20:.0f} MiB used of "
            f"{self.limit_bytes / 2**20:.0f} MiB, headroom {self.fraction:.3f}"
        )


def process_rss_bytes(proc: str | os.PathLike[str] = "/proc/self") -> int:
    """This process's resident set size (``statm``'s resident pages times the page size)."""
    fields = (Path(proc) / "statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def cgroup_memory_limit(
    proc: str | os.PathLike[str] = "/proc/self", *, prefix: str | os.PathLike[str] = "/"
) -> int | None:
    """The memory limit of this process's cgroup (v2 or v1) in bytes, or None when unlimited.

    ``prefix`` is prepended to the mount points found in ``mountinfo`` (a copy of
    a host's files under a test folder). Unreadable files mean no known limit.
    """
    proc = Path(proc)
    try:
        membership = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in membership:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            found = _mount(mounts, "cgroup2", None)
            name = "memory.max"
        elif "memory" in controllers.split(","):
            found = _mount(mounts, "cgroup", "memory")
            name = "memory.limit_in_bytes"
        else:
            continue
        if found is None:
            continue
        root, point = found
        limit = _smallest_limit(Path(prefix) / point.lstrip("/"), root, path, name)
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def headroom(
    device: torch.device, *, limit_bytes: int | None = None, proc: str = "/proc/self"
) -> Headroom | None:
    """This rank's memory headroom on ``device``, or None when there is no limit to measure."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Headroom(str(device), total - free, total)
    limit = limit_bytes if limit_bytes is not None else cgroup_memory_limit(proc)
    if limit is None:
        return None
    return Headroom("cpu", process_rss_bytes(proc), limit)


def _mount(mounts: list[str], fstype: str, option: str | None) -> tuple[str, str] | None:
    """``(root within the hierarchy, mount point)`` of the first matching cgroup mount."""
    for line in mounts:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if option is not None and option not in tail[2].split(","):
            continue
        return fields[3], fields[4]
    return None


def _smallest_limit(mount: Path, root: str, path: str, name: str) -> int | None:
    """The smallest limit from the cgroup's folder up to the mounted root."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root) :]
    folder = mount / rel.lstrip("/")
    if not folder.is_dir():
        folder = mount  # a namespaced container sees its own cgroup at the mount point
    best: int | None = None
    while True:
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            text = ""
        if text and text != "max" and int(text) < _V1_UNLIMITED:
            best = int(text) if best is None else min(best, int(text))
        if folder == mount or mount not in folder.parents:
            return best
        folder = folder.parent

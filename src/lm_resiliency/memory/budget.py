"""How much a memory filesystem (and this process's memory cgroup) can still take.

Files on tmpfs are charged to the memory cgroup of the process that first
touched their pages, so a container can be out of memory long before the
filesystem is full. Both are checked before the first slot is reserved; the
cgroup limit is read where the kernel exposes it (v2 ``memory.max``, v1
``memory.limit_in_bytes``) and ignored where it cannot be read.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_UNLIMITED = 1 << 60
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def filesystem_free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still allocate on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    with contextlib.suppress(ValueError):
        value = int(text)
        return None if value >= _UNLIMITED else value
    return None


def cgroup_available_bytes() -> int | None:
    """Memory this process's cgroup may still charge (limit - usage), or ``None`` if unlimited
    or unreadable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            base = _CGROUP_ROOT / rel
            limit, usage = base / "memory.max", base / "memory.current"
        elif "memory" in controllers.split(","):
            base = _CGROUP_ROOT / "memory" / rel
            limit, usage = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None:
            return max(0, cap - used)
    return None

"""Where files live inside ``disk_folder``.

::

    <disk_folder>/run-<sha256(run_id)[:16]>/run.json
                 /run-.../topo-<sha256(topology)[:16]>/topology.json
                 /run-.../topo-.../status-rank-<R>.json          (per-rank sidecar)
                 /run-.../topo-.../scout-catalog-rank-<R>.json   (SCOUT's replay shapes)
                 /run-.../topo-.../step-<N>/rank-<O>.safetensors (owner O's state at step N)

Directory names are opaque but deterministic, so every rank of a run finds the
same place without coordination and an unrelated run never shares it. The
small manifests name the exact run id and topology for ``lm-resiliency
inspect``; a manifest that names another identity (a prefix collision or a
tampered folder) is refused. A peer replica is stored under its *owner's* rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from lm_resiliency._safefs import open_file_nofollow, pread_exact
from lm_resiliency.errors import IdentityMismatch
from lm_resiliency.persistence.publish import publish_bytes

RUN_MANIFEST = "run.json"
TOPOLOGY_MANIFEST = "topology.json"
_RUN_KIND = "lm_resiliency.run"
_TOPOLOGY_KIND = "lm_resiliency.topology"
_MAX_MANIFEST_BYTES = 1 << 20
_RUN_RE = re.compile(r"run-[0-9a-f]{16}")
_TOPO_RE = re.compile(r"topo-[0-9a-f]{16}")
_STEP_RE = re.compile(r"step-(0|[1-9][0-9]{0,18})")
_SHARD_RE = re.compile(r"rank-(0|[1-9][0-9]{0,9})\.safetensors")
_SIDECAR_RE = re.compile(r"status-rank-(0|[1-9][0-9]{0,9})\.json")
_MARKER_RE = re.compile(r"trust-rank-(0|[1-9][0-9]{0,9})\.json")


def _h16(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_dir(run_id: str) -> str:
    """Directory name of ``run_id``."""
    return f"run-{_h16(run_id)}"


def topology_dir(topology: str) -> str:
    """Directory name of a topology fingerprint (below its run directory)."""
    return f"topo-{_h16(topology)}"


def step_dir(step: int) -> str:
    """Directory name of one generation."""
    return f"step-{step}"


def shard_file(owner_rank: int) -> str:
    """File name of ``owner_rank``'s shard inside a step directory."""
    return f"rank-{owner_rank}.safetensors"


TRUST_MARKER_KIND = "lm_resiliency.trust"


def trust_marker_file(owner_rank: int) -> str:
    """File name of the trust marker of ``owner_rank``'s shard inside a step directory."""
    return f"trust-rank-{owner_rank}.json"


def sidecar_file(rank: int) -> str:
    """File name of ``rank``'s status sidecar inside the topology directory."""
    return f"status-rank-{rank}.json"


def catalog_file(rank: int) -> str:
    """File name of ``rank``'s saved SCOUT catalog (replay shapes) inside the topology directory."""
    return f"scout-catalog-rank-{rank}.json"


def is_run_dir(name: str) -> bool:
    return _RUN_RE.fullmatch(name) is not None


def is_topology_dir(name: str) -> bool:
    return _TOPO_RE.fullmatch(name) is not None


def parse_step_dir(name: str) -> int | None:
    """The step of a canonical ``step-<N>`` name, else ``None``."""
    m = _STEP_RE.fullmatch(name)
    return int(m[1]) if m else None


def parse_shard_file(name: str) -> int | None:
    """The owner rank of a canonical ``rank-<R>.safetensors`` name, else ``None``."""
    m = _SHARD_RE.fullmatch(name)
    return int(m[1]) if m else None


def parse_trust_marker_file(name: str) -> int | None:
    """The owner rank of a canonical ``trust-rank-<R>.json`` name, else ``None``."""
    m = _MARKER_RE.fullmatch(name)
    return int(m[1]) if m else None


def parse_sidecar_file(name: str) -> int | None:
    """The rank of a canonical ``status-rank-<R>.json`` name, else ``None``."""
    m = _SIDECAR_RE.fullmatch(name)
    return int(m[1]) if m else None


def read_manifest(dir_fd: int, name: str, *, where: str) -> dict[str, Any] | None:
    """A manifest's JSON object, ``None`` if absent or unreadable (never follows a link).

    ``where`` is the manifest's path for messages. Raises ``UnsafePathError`` when the
    entry is a symlink, FIFO, device or a file of another user (never blocks on it).
    """

    try:
        fd = open_file_nofollow(dir_fd, name, os.O_RDONLY, where=where)
    except FileNotFoundError:
        return None
    try:
        raw = pread_exact(fd, _MAX_MANIFEST_BYTES, 0)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


_MANIFESTS = {
    RUN_MANIFEST: (_RUN_KIND, "run_id", run_dir),
    TOPOLOGY_MANIFEST: (_TOPOLOGY_KIND, "topology", topology_dir),
}


def _mismatch(where: str, key: str, found: object, wanted: str) -> IdentityMismatch:
    return IdentityMismatch(
        f"{where} names {key}={found!r:.200}, not {wanted}; the folder was altered or "
        "reused by another run. Move it aside or choose another disk_folder"
    )


def check_manifest(doc: dict[str, Any], name: str, *, dir_name: str, where: str) -> str:
    """The identity manifest ``name`` (``run.json`` or ``topology.json``) names, when it
    is one the store accepts in directory ``dir_name``: the right kind, and an identity
    whose directory name is ``dir_name``. For tools that do not know the identity
    beforehand (``lm-resiliency inspect``); raises ``IdentityMismatch`` otherwise.
    """
    kind, key, dirname_of = _MANIFESTS[name]
    value = doc.get(key)
    if doc.get("kind") != kind or not isinstance(value, str) or not value:
        raise _mismatch(where, key, value, f"a {kind} manifest")
    if dirname_of(value) != dir_name:
        raise _mismatch(where, key, value, f"the identity of its directory {dir_name}")
    return value


def _ensure(dir_fd: int, name: str, *, kind: str, key: str, value: str, where: str) -> None:
    dir_name = os.path.basename(where)
    where = os.path.join(where, name)
    doc = read_manifest(dir_fd, name, where=where)
    if doc is None:
        body = {"kind": kind, "version": 1, key: value}
        publish_bytes(dir_fd, name, json.dumps(body, indent=1).encode() + b"\n")
        return
    if doc.get(key) != value:  # the expected identity is known here: name it
        raise _mismatch(where, key, doc.get(key), repr(value))
    check_manifest(doc, name, dir_name=dir_name, where=where)


def ensure_run_manifest(dir_fd: int, run_id: str, *, where: str) -> None:
    """Write ``run.json`` naming ``run_id`` if absent; ``IdentityMismatch`` if it names another.

    ``where`` is the run directory's path. Raises ``UnsafePathError`` for an unsafe entry.
    """
    _ensure(dir_fd, RUN_MANIFEST, kind=_RUN_KIND, key="run_id", value=run_id, where=where)


def ensure_topology_manifest(dir_fd: int, topology: str, *, where: str) -> None:
    """Write ``topology.json`` if absent; raise ``IdentityMismatch`` if it names another."""
    _ensure(
        dir_fd, TOPOLOGY_MANIFEST, kind=_TOPOLOGY_KIND, key="topology", value=topology, where=where
    )

"""Run identity and topology fingerprints: what binds node-local files to one job.

run_id, first found wins: the explicit value (config), ``LM_RESILIENCY_RUN_ID``,
``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id; its placeholder default
``"none"`` is not an identity and is skipped), else a fresh random id agreed by
the group (rank 0's, broadcast as bytes in a ``uint8`` tensor - no pickle). So
a job that reuses ``disk_folder`` without an identity inherits nothing. In every
case all ranks then check that they hold the same id and raise
``IdentityMismatch`` naming the ranks that differ.

Topology: each checkpoint group fingerprints its member ranks and replication
pairs (:func:`topology_fingerprint`); :func:`agree_job_fingerprint` all-gathers
every rank's group fingerprint and hashes them in rank order into one job-wide
fingerprint (:func:`job_fingerprint`), after checking that the members of each
group agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from lm_resiliency.errors import ConfigError, IdentityMismatch

RUN_ID_ENV = "LM_RESILIENCY_RUN_ID"
ELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
#: Longest run_id accepted (bytes of UTF-8), so agreement exchanges a fixed size.
MAX_RUN_ID_BYTES = 256
_FRESH_BYTES = 32  # uuid4().hex
_ELASTIC_PLACEHOLDERS = {"", "none"}


def local_run_id(
    run_id: str | None = None, *, env: Mapping[str, str] | None = None
) -> tuple[str | None, str]:
    """This rank's choice before agreement: ``(value or None, source)``. Not collective.

    ``source`` is ``"config"``, the environment variable's name, or ``"fresh"``
    (no identity: the group must agree on a new one).
    """
    env = os.environ if env is None else env
    candidates = (
        ("config", run_id),
        (RUN_ID_ENV, env.get(RUN_ID_ENV)),
        (ELASTIC_RUN_ID_ENV, env.get(ELASTIC_RUN_ID_ENV)),
    )
    for source, value in candidates:
        if value is None or (
            source == ELASTIC_RUN_ID_ENV and value.strip().lower() in _ELASTIC_PLACEHOLDERS
        ):
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"run_id from {source} is {value!r}; it must be a non-empty string")
        if len(value.encode()) > MAX_RUN_ID_BYTES:
            raise ConfigError(
                f"run_id from {source} is {len(value.encode())} bytes; "
                f"use at most {MAX_RUN_ID_BYTES}"
            )
        return value, source
    return None, "fresh"


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def resolve_run_id(
    run_id: str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The run id every rank of ``group`` agrees on (see the module docstring for the order).

    Collective over ``group`` (default: the world) when ``torch.distributed``
    is initialized: every rank must call it. Without a process group it
    resolves locally. Raises ``ConfigError`` for an empty or oversized value
    and ``IdentityMismatch`` when ranks resolve different ids.
    """
    value, source = local_run_id(run_id, env=env)
    if _group_size(group) == 1:
        return value if value is not None else uuid.uuid4().hex
    device = _device(group)
    # Every rank takes part in the broadcast whatever its source, so ranks that
    # were configured differently still issue the same collectives and fail in
    # the agreement check below instead of hanging.
    fresh = torch.frombuffer(bytearray(uuid.uuid4().hex.encode()), dtype=torch.uint8).to(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(fresh, src=src, group=group)
    if value is None:
        value = bytes(fresh.cpu().tolist()).decode()
    _check_agreement(value, source, group, device)
    return value


def _check_agreement(
    value: str, source: str, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    world = _group_size(group)
    mine = _pack(value, source)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    views = [_unpack(t.cpu()) for t in gathered]
    if all(v[0] == views[0][0] for v in views):
        return
    lines = [f"rank {r}: run_id={v!r} (from {s})" for r, (v, s) in enumerate(views)]
    raise IdentityMismatch(
        "ranks disagree on the run id; set the same run_id (or LM_RESILIENCY_RUN_ID) on every "
        "rank, or none on any so they agree on a fresh one:\n  " + "\n  ".join(lines)
    )


def _pack(value: str, source: str) -> torch.Tensor:
    raw = json.dumps([value, source], ensure_ascii=False).encode()
    # Worst case: every byte escaped as \u00XX (6 bytes) plus the source name.
    buf = bytearray(4 + 6 * MAX_RUN_ID_BYTES + 64)
    assert len(raw) <= len(buf) - 4, len(raw)
    buf[:4] = len(raw).to_bytes(4, "little")
    buf[4 : 4 + len(raw)] = raw
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def _unpack(t: torch.Tensor) -> tuple[str, str]:
    raw = bytes(t.tolist())
    n = int.from_bytes(raw[:4], "little")
    value, source = json.loads(raw[4 : 4 + n].decode())
    return str(value), str(source)


def topology_fingerprint(group_ranks: Sequence[int], pairs: Iterable[tuple[int, int]]) -> str:
    """Fingerprint (64 hex chars) of one checkpoint group: its ranks and replication pairs.

    ``pairs`` are ``(owner, holder)`` rank pairs: ``holder`` keeps ``owner``'s
    replica. Order does not matter (both are canonicalised); every rank of a
    pair must be in ``group_ranks``. Raises ``ConfigError`` otherwise.
    """
    ranks = list(group_ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(_rank(r) for r in ranks):
        raise ConfigError(f"group_ranks={ranks!r} must be distinct non-negative ints, at least one")
    canon_pairs = sorted({(int(a), int(b)) for a, b in pairs})
    members = set(ranks)
    bad = [p for p in canon_pairs if not (set(p) <= members)]
    if bad:
        raise ConfigError(f"replication pairs {bad} name ranks outside the group {sorted(ranks)}")
    body = json.dumps({"ranks": sorted(ranks), "pairs": canon_pairs}, separators=(",", ":"))
    return hashlib.sha256(b"lm_resiliency.topology.group/1" + body.encode()).hexdigest()


def job_fingerprint(ordered_group_fingerprints: Sequence[str]) -> str:
    """Job-wide fingerprint (64 hex chars) from per-rank group fingerprints in rank order."""
    fps = list(ordered_group_fingerprints)
    if not fps or not all(_is_fp(f) for f in fps):
        raise ConfigError("ordered_group_fingerprints must be a non-empty list of 64-hex strings")
    body = json.dumps(fps, separators=(",", ":"))
    return hashlib.sha256(b"lm_resiliency.topology.job/1" + body.encode()).hexdigest()


def agree_job_fingerprint(
    group_fingerprint: str,
    *,
    group_ranks: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> str:
    """Collective over ``group`` (default: world): the job-wide topology fingerprint.

    Every rank passes its own checkpoint group's fingerprint and, with
    ``group_ranks`` (ranks of ``group``), the members of its checkpoint
    group, which must all have reported the same fingerprint. Raises
    ``IdentityMismatch`` naming the disagreeing ranks.
    """
    if not _is_fp(group_fingerprint):
        raise ConfigError(f"group_fingerprint={group_fingerprint!r} is not 64 hex characters")
    world = _group_size(group)
    if world == 1:
        return job_fingerprint([group_fingerprint])
    device = _device(group)
    mine = torch.frombuffer(bytearray(bytes.fromhex(group_fingerprint)), dtype=torch.uint8)
    gathered = [torch.empty(32, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    fps = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if group_ranks is not None:
        differ = [r for r in group_ranks if not 0 <= r < world or fps[r] != group_fingerprint]
        if differ:
            me = dist.get_rank(group)
            raise IdentityMismatch(
                f"rank {me}: members {differ} of checkpoint group {list(group_ranks)} report a "
                f"different group fingerprint than {group_fingerprint[:16]}...; every member must "
                "pass the same group ranks and replication pairs"
            )
    return job_fingerprint(fps)


def _rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_fp(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )

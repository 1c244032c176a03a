"""Per-rank status sidecar: which persisted steps are candidate or recovery-verified.

Each rank owns exactly one sidecar file (``status-rank-<R>.json`` in its
topology directory), so several workers on one node never update the same
trust record. It is replaced atomically (same-directory temp + rename) on every
change. Schema (every key required, no others)::

    {"kind": "lm_resiliency.status", "version": 1,
     "run_id": str, "topology": str, "rank": int,
     "candidate_step": int | null, "verified_step": int | null,
     "verified_history": [int, ...]   (strictly ascending, newest last),
     "persisted": {"<owner rank>": <newest step persisted by this rank>, ...}}

Version 2 (written only when one of its fields is set, so a record without them
stays readable by version-1 readers) adds two keys, both required in version 2::

     "rejected": [{"step": int, "reason": str}, ...]   (strictly ascending steps),
     "verdict": null | {"mode": "recovery_verified", "step": int, "reason": str}

``rejected`` lists generations SCOUT rejected and why; ``verdict`` is SCOUT's
"SDC seen: recover in verified mode" instruction for a restarted job. Version-1
files are read as having neither.

Readers retry only *visibility* failures - bytes that do not decode as UTF-8
or do not parse as JSON, which a remote filesystem client can briefly observe
while another client replaces the file - for a bounded time. A decoded
document with another identity, an unknown schema or inconsistent trust
fields fails closed at once with ``SidecarUnavailable``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lm_resiliency._safefs import open_file_nofollow, pread_exact
from lm_resiliency.errors import SidecarUnavailable, UnsafePathError
from lm_resiliency.knobs import SIDECAR_RETRY_S
from lm_resiliency.persistence.namespace import sidecar_file
from lm_resiliency.persistence.publish import publish_bytes
from lm_resiliency.persistence.trust import RECOVERY_VERDICT_MODE, RecoveryVerdict

SIDECAR_KIND = "lm_resiliency.status"
SIDECAR_VERSION = 1
#: The version written when ``rejected`` or ``verdict`` is set (readers accept 1 and 2).
SIDECAR_VERSION_TRUST = 2
#: Longest reason text a reader accepts in ``rejected`` / ``verdict``.
MAX_REASON_CHARS = 2000
#: Default bound on the verified history a writer keeps.
DEFAULT_HISTORY_LIMIT = 16
#: Longest history a reader accepts (a larger one is treated as damaged).
MAX_HISTORY = 4096
_MAX_SIDECAR_BYTES = 1 << 20
_KEYS = {
    "kind",
    "version",
    "run_id",
    "topology",
    "rank",
    "candidate_step",
    "verified_step",
    "verified_history",
    "persisted",
}
_KEYS_V2 = _KEYS | {"rejected", "verdict"}


@dataclass(frozen=True)
class SidecarStatus:
    """One rank's trust record. Immutable: the ``with_*`` methods return updated copies."""

    run_id: str
    topology: str
    rank: int
    candidate_step: int | None = None
    verified_step: int | None = None
    verified_history: tuple[int, ...] = ()
    persisted: dict[int, int] = field(default_factory=dict)
    """Owner rank -> newest step of that owner's state this rank persisted."""
    rejected: tuple[tuple[int, str], ...] = ()
    """``(step, reason)`` of generations SCOUT rejected, ascending by step."""
    verdict: RecoveryVerdict | None = None
    """SCOUT's persisted instruction to recover in verified mode, if any."""

    @property
    def persisted_step(self) -> int | None:
        """Newest persisted step of this rank's own state."""
        return self.persisted.get(self.rank)

    def with_candidate(self, step: int) -> SidecarStatus:
        """``step`` recorded as the current candidate."""
        return replace(self._without_rejection(step), candidate_step=step)

    def with_verified(self, step: int, *, history_limit: int) -> SidecarStatus:
        """``step`` added to the verified history (newest ``history_limit`` kept).

        A candidate at or below the newest verified step is cleared: it has
        been promoted or superseded.
        """
        history = sorted({*self.verified_history, step})[-history_limit:]
        newest = history[-1]
        candidate = self.candidate_step
        if candidate is not None and candidate <= newest:
            candidate = None
        return replace(
            self._without_rejection(step),
            verified_history=tuple(history),
            verified_step=newest,
            candidate_step=candidate,
        )

    def with_persisted(self, owner_rank: int, step: int) -> SidecarStatus:
        """``step`` recorded as the newest persisted step of ``owner_rank`` (never moves back)."""
        newest = max(step, self.persisted.get(owner_rank, step))
        return replace(self, persisted={**self.persisted, owner_rank: newest})

    def with_rejected(self, step: int, reason: str, *, history_limit: int) -> SidecarStatus:
        """``step`` recorded as rejected with ``reason`` (newest ``history_limit`` kept).

        A rejected step leaves the verified history and stops being the candidate.
        """
        rejected = {s: r for s, r in self.rejected if s != step}
        rejected[step] = reason
        kept = tuple(sorted(rejected.items())[-history_limit:])
        history = tuple(s for s in self.verified_history if s != step)
        candidate = None if self.candidate_step == step else self.candidate_step
        return replace(
            self,
            rejected=kept,
            verified_history=history,
            verified_step=history[-1] if history else None,
            candidate_step=candidate,
        )

    def with_verdict(self, verdict: RecoveryVerdict | None) -> SidecarStatus:
        """SCOUT's recovery verdict set (or cleared with ``None``)."""
        return replace(self, verdict=verdict)

    def _without_rejection(self, step: int) -> SidecarStatus:
        # A new capture of a step number (after a rewind) supersedes its old rejection.
        if all(s != step for s, _ in self.rejected):
            return self
        return replace(self, rejected=tuple((s, r) for s, r in self.rejected if s != step))

    def to_json(self) -> dict[str, Any]:
        if self.rejected or self.verdict is not None:
            return self._to_json_v2()
        return {
            "kind": SIDECAR_KIND,
            "version": SIDECAR_VERSION,
            "run_id": self.run_id,
            "topology": self.topology,
            "rank": self.rank,
            "candidate_step": self.candidate_step,
            "verified_step": self.verified_step,
            "verified_history": list(self.verified_history),
            "persisted": {str(k): v for k, v in sorted(self.persisted.items())},
        }

    def _to_json_v2(self) -> dict[str, Any]:
        v = self.verdict
        return {
            **replace(self, rejected=(), verdict=None).to_json(),
            "version": SIDECAR_VERSION_TRUST,
            "rejected": [{"step": s, "reason": r} for s, r in self.rejected],
            "verdict": None if v is None else {"mode": v.mode, "step": v.step, "reason": v.reason},
        }


def _step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_status(doc: Any, *, run_id: str, topology: str, rank: int, path: str) -> SidecarStatus:
    """Validate a decoded sidecar against the expected identity; fail closed otherwise."""

    def fail(reason: str, detail: str) -> SidecarUnavailable:
        return SidecarUnavailable(
            f"status sidecar {path} is unusable ({reason}): {detail}; the rank's trust "
            "status is treated as unknown (recovery falls back to the common verified step)",
            reason=reason,
            path=path,
        )

    if not isinstance(doc, dict) or doc.get("kind") != SIDECAR_KIND:
        raise fail("schema", "not an lm-resiliency status document")
    version: Any = doc.get("version")
    known = {SIDECAR_VERSION: _KEYS, SIDECAR_VERSION_TRUST: _KEYS_V2}
    expected_keys = known.get(version) if isinstance(version, int) else None
    if isinstance(version, bool) or expected_keys is None or set(doc) != expected_keys:
        raise fail("schema", f"version {version!r} with keys {sorted(doc)}")
    found = (doc["run_id"], doc["topology"], doc["rank"])
    if found != (run_id, topology, rank):
        raise fail(
            "identity",
            f"it names (run_id, topology, rank)={found!r}, expected {(run_id, topology, rank)!r}",
        )
    history, verified, candidate = (
        doc["verified_history"],
        doc["verified_step"],
        doc["candidate_step"],
    )
    persisted = doc["persisted"]
    if (
        not isinstance(history, list)
        or len(history) > MAX_HISTORY
        or not all(_step(s) for s in history)
        or not (candidate is None or _step(candidate))
        or not (verified is None or _step(verified))
        or not isinstance(persisted, dict)
        or not all(k.isdigit() and _step(v) for k, v in persisted.items())
    ):
        raise fail("schema", "a step field is not a non-negative integer (or list/map of them)")
    if any(a >= b for a, b in itertools.pairwise(history)):
        raise fail("trust", f"verified_history {history[:8]}... is not strictly ascending")
    if verified != (history[-1] if history else None):
        raise fail("trust", f"verified_step={verified!r} is not the newest of {history[-8:]}")
    rejected: tuple[tuple[int, str], ...] = ()
    verdict: RecoveryVerdict | None = None
    if version == SIDECAR_VERSION_TRUST:
        rejected, verdict = _parse_trust_v2(doc, fail)
    return SidecarStatus(
        run_id=run_id,
        topology=topology,
        rank=rank,
        candidate_step=candidate,
        verified_step=verified,
        verified_history=tuple(history),
        persisted={int(k): v for k, v in persisted.items()},
        rejected=rejected,
        verdict=verdict,
    )


def _reason(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_REASON_CHARS


def _parse_trust_v2(
    doc: dict[str, Any], fail: Callable[[str, str], SidecarUnavailable]
) -> tuple[tuple[tuple[int, str], ...], RecoveryVerdict | None]:
    """The version-2 fields ``rejected`` and ``verdict``, validated (fail closed)."""
    raw, v = doc["rejected"], doc["verdict"]
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_HISTORY
        or not all(
            isinstance(e, dict) and set(e) == {"step", "reason"} and _step(e["step"]) for e in raw
        )
        or not all(_reason(e["reason"]) for e in raw)
    ):
        raise fail("schema", "rejected is not a list of {step, reason} records")
    rejected = tuple((e["step"], e["reason"]) for e in raw)
    if any(a[0] >= b[0] for a, b in itertools.pairwise(rejected)):
        raise fail("trust", f"rejected steps {[s for s, _ in rejected][:8]} are not ascending")
    if v is None:
        return rejected, None
    if (
        not isinstance(v, dict)
        or set(v) != {"mode", "step", "reason"}
        or v["mode"] != RECOVERY_VERDICT_MODE
        or not _step(v["step"])
        or not _reason(v["reason"])
    ):
        raise fail("schema", f"verdict {str(v)[:200]} is not a recovery_verified verdict")
    return rejected, RecoveryVerdict(step=v["step"], reason=v["reason"], mode=v["mode"])


def read_status(
    topo_fd: int,
    *,
    run_id: str,
    topology: str,
    rank: int,
    where: str,
    retry_s: float = SIDECAR_RETRY_S,
) -> SidecarStatus | None:
    """Read ``rank``'s sidecar; ``None`` if it does not exist (nothing recorded yet).

    Retries undecodable bytes for up to ``retry_s``; after that, and for any
    identity, schema or trust mismatch at once, raises ``SidecarUnavailable``
    - also, without waiting, for a symlink, FIFO, device or a file owned by
    another user in its place (``reason`` as in ``UnsafePathError``).
    """
    deadline = time.monotonic() + retry_s
    pause_s = 0.002
    while True:
        try:
            fd = open_file_nofollow(topo_fd, sidecar_file(rank), os.O_RDONLY, where=where)
        except FileNotFoundError:
            return None
        except UnsafePathError as exc:  # a link, FIFO, device or another user's file
            raise SidecarUnavailable(
                f"status sidecar {where} is unusable ({exc.reason}): {exc}; the rank's trust "
                "status is treated as unknown (recovery falls back to the common verified step)",
                reason=exc.reason,
                path=where,
            ) from None
        try:
            raw = pread_exact(fd, _MAX_SIDECAR_BYTES, 0)
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise SidecarUnavailable(
                    f"status sidecar {where} stayed undecodable for {retry_s}s ({exc}); the rank's "
                    "trust status is treated as unknown",
                    reason="malformed",
                    path=where,
                ) from None
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.1)
            continue
        return parse_status(doc, run_id=run_id, topology=topology, rank=rank, path=where)


def write_status(topo_fd: int, status: SidecarStatus) -> None:
    """Atomically replace ``status.rank``'s sidecar (temp, fsync, rename, directory fsync)."""
    body = json.dumps(status.to_json(), indent=1).encode() + b"\n"
    publish_bytes(topo_fd, sidecar_file(status.rank), body)

"""Trust per generation in a checkpoint folder: verified, candidate, rejected, and why.

For ``lm-resiliency inspect``: read-only, nothing is created or followed through a
symlink. A shard's header records the trust known when it was written; the
owner rank's status sidecar records what happened since (a candidate promoted
to verified, a rejection by SCOUT and its reason). The sidecar wins when this
node has it; a replica held for a rank on another node shows its header trust.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lm_resiliency._safefs import opened_dir
from lm_resiliency.errors import SidecarUnavailable, UnsafePathError
from lm_resiliency.persistence.scan import scan_checkpoints
from lm_resiliency.persistence.sidecar import SidecarStatus, read_status
from lm_resiliency.persistence.trust import RecoveryVerdict, TrustStatus

VERIFIED = TrustStatus.RECOVERY_VERIFIED.value
CANDIDATE = TrustStatus.CANDIDATE.value
UNVERIFIED = TrustStatus.UNVERIFIED.value
REJECTED = "rejected"
MIXED = "mixed"


@dataclass(frozen=True)
class RankTrust:
    """One owner rank's shard of a generation: its effective trust and where that came from."""

    trust: str
    why: str


@dataclass(frozen=True)
class GenerationTrust:
    """One generation (step) of one topology: trust over every shard found here."""

    step: int
    trust: str
    """``recovery_verified``, ``candidate``, ``rejected``, ``unverified`` or ``mixed``."""
    why: str
    ranks: dict[int, RankTrust] = field(default_factory=dict)


@dataclass(frozen=True)
class TopologyTrust:
    run: str
    run_id: str | None
    topology: str
    generations: list[GenerationTrust]
    verdicts: dict[int, RecoveryVerdict]
    """Rank -> SCOUT's persisted "recover in verified mode" verdict."""
    unreadable: dict[int, str]
    """Rank -> why its sidecar could not be used (its trust is treated as unknown)."""


def _rank_trust(step: int, header: str | None, status: SidecarStatus | None) -> RankTrust:
    if status is not None:
        for s, reason in status.rejected:
            if s == step:
                return RankTrust(REJECTED, reason)
        if step in status.verified_history:
            return RankTrust(VERIFIED, "recovery-verified in the owner's sidecar")
        if status.candidate_step == step:
            return RankTrust(CANDIDATE, "the owner's current candidate")
        if header in (VERIFIED, CANDIDATE):
            return RankTrust(UNVERIFIED, f"written as {header}, not in the owner's sidecar now")
        return RankTrust(UNVERIFIED, "not certified")
    trust = header or UNVERIFIED
    return RankTrust(trust, "from the shard header (the owner's sidecar is not on this node)")


def _combine(step: int, ranks: dict[int, RankTrust]) -> GenerationTrust:
    kinds = {r.trust for r in ranks.values()}
    if REJECTED in kinds:
        rank, first = next((r, t) for r, t in sorted(ranks.items()) if t.trust == REJECTED)
        return GenerationTrust(step, REJECTED, f"rank {rank}: {first.why}", ranks)
    if len(kinds) == 1:
        (kind,) = kinds
        why = {
            VERIFIED: "every rank recorded it as recovery-verified",
            CANDIDATE: "candidate on every rank (excluded from verified recovery)",
            UNVERIFIED: "captured, not certified",
        }.get(kind, kind)
        return GenerationTrust(step, kind, why, ranks)
    parts = ", ".join(f"rank {r}: {t.trust}" for r, t in sorted(ranks.items()))
    return GenerationTrust(step, MIXED, f"ranks disagree ({parts}); not verified", ranks)


def trust_report(folder: str | Path) -> list[TopologyTrust]:
    """Trust of every generation under ``folder``, per run and topology (sorted)."""
    root = Path(folder).resolve(strict=True)
    out: list[TopologyTrust] = []
    for run in scan_checkpoints(root):
        for topo in run.topologies:
            statuses: dict[int, SidecarStatus] = {}
            unreadable: dict[int, str] = {}
            if run.run_id and topo.topology:
                with opened_dir(root, (run.name, topo.name), create=False) as topo_fd:
                    for rank in sorted(topo.sidecars):
                        where = str(root / run.name / topo.name / f"status-rank-{rank}.json")
                        try:
                            status = read_status(
                                topo_fd,
                                run_id=run.run_id,
                                topology=topo.topology,
                                rank=rank,
                                where=where,
                                retry_s=0.5,
                            )
                        except (SidecarUnavailable, UnsafePathError) as exc:
                            unreadable[rank] = str(exc)
                            continue
                        if status is not None:
                            statuses[rank] = status
            generations = []
            for gen in topo.generations:
                ranks = {
                    s.owner_rank: _rank_trust(gen.step, s.trust, statuses.get(s.owner_rank))
                    for s in gen.shards
                    if s.problem is None
                }
                if ranks:
                    generations.append(_combine(gen.step, ranks))
            verdicts = {r: s.verdict for r, s in statuses.items() if s.verdict is not None}
            out.append(
                TopologyTrust(run.name, run.run_id, topo.name, generations, verdicts, unreadable)
            )
    return out

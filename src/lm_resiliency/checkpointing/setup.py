"""What the manager's constructor decides before any slot exists: pairing, memory tier, layout.

Pure functions of the configuration and the agreed identity (run id,
topology); the constructor calls them in this order: :func:`pairing` (before
the topology is fingerprinted), :func:`memory_tier` (after), and at recovery
:func:`disk_topologies` says whether the run has files for another topology.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.errors import ConfigError
from lm_resiliency.memory import MemoryFolder, MemoryTier
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.replication import PairingPlan, resolve_jump

log = logging.getLogger(__name__)

__all__ = ["describe_plan", "disk_topologies", "memory_tier", "pairing"]


def pairing(
    rank: int,
    world_size: int,
    replication_jump: int,
    *,
    hsdp: bool,
    replica_ranks: Sequence[int] | None,
) -> PairingPlan | None:
    """The replication plan, or in HSDP mode the plan that links a rank to its replicas.

    Raises ``ConfigError`` for replica ranks that are not an evenly spaced
    replicate dimension containing ``rank``.
    """
    if not hsdp:
        return PairingPlan.build(world_size, resolve_jump(replication_jump, world_size).jump)
    if replica_ranks is None:
        return None
    ranks = sorted(set(replica_ranks))
    if rank not in ranks or not all(0 <= r < world_size for r in ranks):
        raise ConfigError(
            f"replica_ranks={list(replica_ranks)} must be ranks of the checkpoint group "
            f"(0..{world_size - 1}) including this rank {rank}"
        )
    if len(ranks) < 2:
        return None
    gaps = {b - a for a, b in itertools.pairwise(ranks)}
    jump = ranks[1] - ranks[0]
    if len(gaps) != 1 or len(ranks) * jump != world_size:
        raise ConfigError(
            f"replica_ranks={ranks} must be evenly spaced across the whole group (the "
            f"replicate dimension of a replicate-major mesh, e.g. [r, r + {jump}, ...] "
            f"covering {world_size} ranks)"
        )
    return PairingPlan.build(world_size, jump)


def describe_plan(plan: PairingPlan | None, *, hsdp: bool) -> str:
    if hsdp:
        return "HSDP replicas (no transfer at capture)" + (
            f"; recovery from replica ranks via {plan.describe()}" if plan else ""
        )
    return plan.describe() if plan is not None else "no peer"


def memory_tier(
    config: InMemoryCkptConfig,
    *,
    run_id: str,
    topology: str,
    rank: int,
    peer_owner: int | None,
    superseded: list[str],
) -> MemoryTier | None:
    """This rank's memory tier, or ``None`` (``memory_folder=None``, or an unusable folder
    when not ``memory_required``: then one warning says what is lost).

    Appends the names of the run's memory folders of other topologies to ``superseded``
    (never removes them: their job may still run or restart). Raises ``UnsafePathError``
    for a folder that is not ours (never a silent fallback), and what ``MemoryFolder``
    raises when required.
    """
    folder_path = config.memory_folder
    if folder_path is None:
        return None
    try:
        folder = MemoryFolder(folder_path, run_id=run_id, topology=topology, rank=rank)
    except (ConfigError, OSError) as exc:
        if config.memory_required:
            raise
        log.warning(
            "rank %d: memory_folder %s is unusable (%s); in-memory checkpoints use process "
            "memory and do not survive a crash of this process",
            rank,
            folder_path,
            exc,
        )
        return None
    others = folder.other_topologies()
    superseded.extend(others)
    if others:
        log.info(
            "rank %d: this run has memory slots of other topologies %s; they are kept for the "
            "job they belong to (lm-resiliency clean removes them)",
            rank,
            others,
        )
    return MemoryTier(
        folder,
        run_id=run_id,
        topology=topology,
        rank=rank,
        peer_owner=peer_owner,
        verify_integrity=config.verify_integrity,
        required=config.memory_required,
        slots=2 if peer_owner is None else 4,
    )


def disk_topologies(disk_folder: str | Path, run_id: str, topology: str) -> list[str]:
    """Topology folders of this run on this node's disk other than ``topology``'s, with
    generations in them (another world size, pairing or replica layout)."""
    run = Path(disk_folder) / ns.run_dir(run_id)
    mine = ns.topology_dir(topology)
    if not run.is_dir() or run.is_symlink():
        return []
    return sorted(
        p.name
        for p in run.iterdir()
        if ns.is_topology_dir(p.name)
        and p.name != mine
        and not p.is_symlink()
        and any(ns.parse_step_dir(q.name) is not None for q in p.iterdir())
    )

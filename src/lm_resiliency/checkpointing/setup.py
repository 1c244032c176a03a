"""What the manager's constructor decides before any slot exists: pairing, memory tier, layout.

Pure functions of the configuration, this rank's environment and the agreed
identity (run id, topology); the constructor calls them in this order:
:func:`preflight` (this rank's environment and its :func:`pairing`, before any
collective that could wait on a rank that refuses it), :func:`memory_tier`
(after the topology is fingerprinted), and at recovery :func:`disk_topologies`
says whether the run has files for another topology.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.distributed import restart_count
from lm_resiliency.errors import ConfigError
from lm_resiliency.memory import MemoryFolder, MemoryFolderFull, MemoryTier
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.identity import local_run_id
from lm_resiliency.replication import PairingPlan, resolve_jump

log = logging.getLogger(__name__)

__all__ = [
    "check_disk_folder",
    "describe_plan",
    "disk_topologies",
    "memory_tier",
    "pairing",
    "preflight",
]


def preflight(
    config: InMemoryCkptConfig,
    *,
    rank: int,
    world_size: int,
    hsdp: bool,
    replica_ranks: Sequence[int] | None,
) -> PairingPlan | None:
    """Everything this rank reads from its own environment, checked before any agreement.

    The run id's source (``LM_RESILIENCY_RUN_ID``, ``TORCHELASTIC_RUN_ID``), the
    torchrun restart count, the pairing (``LOCAL_WORLD_SIZE`` for
    ``replication_jump=-1``) and a writable disk folder can differ per rank. Local;
    the manager runs it inside an agreement, so a refusal on one rank is raised on
    every rank instead of leaving the others in the next collective. Returns the
    pairing plan; raises ``ConfigError`` naming the variable or folder and the fix.
    """
    local_run_id(config.run_id)
    restart_count()
    plan = pairing(
        rank, world_size, config.replication_jump, hsdp=hsdp, replica_ranks=replica_ranks
    )
    if config.enable:
        check_disk_folder(config)
    return plan


def check_disk_folder(config: InMemoryCkptConfig) -> None:
    """Refuse a ``disk_folder`` known to be unwritable when anything will be persisted there.

    Looks at the folder, or its nearest existing parent when it does not exist yet
    (persisting creates it), and asks the kernel (``access(2)``: permissions, a
    read-only mount). Nothing is created. Raises ``ConfigError`` naming the folder, the
    operation and the fix.
    """
    why = [
        name
        for name, on in (
            (f"disk_flush_interval={config.disk_flush_interval}", config.disk_flush_interval > 0),
            ("signal_flush=True", config.signal_flush),
            ("flush_on_close=True", config.flush_on_close),
        )
        if on
    ]
    if not why:
        return
    folder = Path(config.disk_folder).absolute()
    probe = folder
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir() or os.access(probe, os.W_OK | os.X_OK):
            return  # a file in the way is refused by the store, with its own message
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return  # cannot even look (a parent we may not enter): the store names that
    where = "is on a read-only filesystem" if read_only else "is not writable by this user"
    target = "it" if probe == folder else f"its parent {probe}"
    action = "write checkpoint files into it" if probe == folder else "create it"
    raise ConfigError(
        f"disk_folder={str(config.disk_folder)!r}: {target} {where}, so persisting "
        f"checkpoints ({', '.join(why)}) cannot {action}; use a writable node-local "
        "directory, or persist nothing (disk_flush_interval=0, signal_flush=False, "
        "flush_on_close=False)"
    )


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
    except (ConfigError, OSError, MemoryFolderFull) as exc:  # full: out of space or inodes
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

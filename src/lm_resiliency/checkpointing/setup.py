"""What the manager's constructor decides before any slot exists: pairing, memory tier, layout.

Pure functions of the configuration, this rank's environment and the agreed
identity (run id, topology); the constructor calls them in this order:
:func:`agree_identity` (:func:`preflight`: this rank's environment and its
:func:`pairing`, before any collective that could wait on a rank that refuses
it; then the run id and the topology fingerprint), :func:`memory_tier`
(after the topology is fingerprinted), :func:`replicas` (the replication
channel and the peer replicas this rank holds), :func:`reattach` (hands the
slots an earlier process of this rank left on the node to the capture engine
and the peer replicas) and :func:`memory_publisher` (the memory folder's copy
of the lineage); at recovery :func:`disk_topologies` says whether the run has
files for another topology.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from lm_resiliency.capture.engine import Adopted, CaptureEngine
from lm_resiliency.capture.slot import ArenaBacking
from lm_resiliency.checkpointing.disk import LocalDisk
from lm_resiliency.checkpointing.flush import DiskFlusher
from lm_resiliency.checkpointing.peer import PeerReplicas
from lm_resiliency.checkpointing.trust import TrustLedger
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.control import ControlPlane
from lm_resiliency.distributed import restart_count
from lm_resiliency.errors import CollectiveTimeout, ConfigError
from lm_resiliency.memory import MemoryFolder, MemoryFolderFull, MemoryTier
from lm_resiliency.persistence import agree_job_fingerprint, resolve_run_id, topology_fingerprint
from lm_resiliency.persistence import namespace as ns
from lm_resiliency.persistence.identity import local_run_id
from lm_resiliency.persistence.lineage import Lineage
from lm_resiliency.replication import PairingPlan, ReplicationChannel, resolve_jump

log = logging.getLogger(__name__)

__all__ = [
    "Identity",
    "Parts",
    "agree_identity",
    "check_disk_folder",
    "describe_plan",
    "disk_topologies",
    "memory_publisher",
    "memory_tier",
    "pairing",
    "preflight",
    "reattach",
    "replicas",
]


@dataclass(frozen=True)
class Identity:
    """What every rank agreed before any slot exists."""

    plan: PairingPlan | None
    run_id: str
    topology: str
    serves: int | None
    """The rank whose state this rank can serve (its replica's owner, or its HSDP partner)."""
    namespace: str
    """Where this group's files and memory slots live: ``topology`` when the group is the
    whole job, else :func:`member_namespace` (disjoint groups share the topology)."""


@dataclass(frozen=True)
class Parts:
    """The parts the manager assembles, handed to the recovery sources and the exit guard."""

    tier: MemoryTier | None
    channel: ReplicationChannel | None
    peer: PeerReplicas | None
    disk: LocalDisk
    trust: TrustLedger
    flusher: DiskFlusher
    engine: CaptureEngine


def agree_identity(
    control: ControlPlane,
    config: InMemoryCkptConfig,
    *,
    hsdp: bool,
    replica_ranks: Sequence[int] | None,
) -> Identity:
    """Collective: check every rank's environment (failing on every rank alike), then agree
    the run id and the job's topology fingerprint.

    The topology is one job-wide fingerprint of the ordered per-rank group fingerprints
    (a group's: its members and replication pairs, in global ranks). When the checkpoint
    group is not the whole job, both agreements run over every rank of the job (each
    rank constructs its manager, with its own group), so disjoint groups share one run
    id and one topology identity; each group's storage keeps its own namespace.
    """
    rank, world = control.rank, control.world_size
    plan = control.agree(
        lambda: preflight(
            config, rank=rank, world_size=world, hsdp=hsdp, replica_ranks=replica_ranks
        ),
        "check this rank's environment",
    )
    if rank == 0:
        log.info("GEMINI replication: %s", describe_plan(plan, hsdp=hsdp))
    serves = plan.recv_from(rank) if plan is not None and plan.has_peer else None
    members = control.global_ranks()
    pairs = [(members[a], members[b]) for a, b in (plan.table() if plan is not None else [])]
    group_fp = topology_fingerprint(members, pairs)
    if not control.distributed or control.world_size == dist.get_world_size():
        # The checkpoint group is the job: its plane is the job's.
        with control.op("agree the run id"):
            run_id = resolve_run_id(config.run_id, group=control.group)
        with control.op("agree the topology"):
            topology = agree_job_fingerprint(group_fp, group=control.group)
        return Identity(plan, run_id, topology, serves, topology)
    job = _job_plane(control, members)
    try:
        with job.op("agree the run id across the job"):
            run_id = resolve_run_id(config.run_id, group=job.group)
        with job.op("agree the job's topology"):
            topology = agree_job_fingerprint(group_fp, group_ranks=members, group=job.group)
    finally:
        job.close()
    return Identity(plan, run_id, topology, serves, member_namespace(topology, group_fp))


def member_namespace(topology: str, group_fingerprint: str) -> str:
    """The storage namespace of one checkpoint group of a job of several.

    Disjoint groups share the job's ``topology`` but number their ranks from 0
    each, so their files and memory slots live under a namespace that also binds
    the group's own fingerprint (its ranks and pairs): one group never reads or
    replaces another's ``rank-0``.
    """
    body = f"{topology}/{group_fingerprint}".encode()
    return hashlib.sha256(b"lm_resiliency.topology.member/1" + body).hexdigest()


def _job_plane(control: ControlPlane, members: Sequence[int]) -> ControlPlane:
    """A bounded plane over every rank of the job, for a manager on a checkpoint group.

    Collective over the world: every training rank constructs its manager at the
    same point. Raises ``CollectiveTimeout`` naming the group when some rank never
    does (within ``control_timeout_s``).
    """
    try:
        return ControlPlane(None, timeout_s=control.timeout_s)
    except RuntimeError as exc:  # torch's distributed errors derive from RuntimeError
        raise CollectiveTimeout(
            f"rank {control.rank} of checkpoint group {list(members)}: the job-wide identity "
            f"(run id and topology) needs every one of the {dist.get_world_size()} training "
            f"ranks to construct its manager, and not all did within control_timeout_s="
            f"{control.timeout_s:g} s; construct a manager on every rank, each with its "
            f"checkpoint group. Gloo said: {str(exc)[:300]}"
        ) from exc


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
    """This rank's memory tier, or ``None`` (``enable=False``, ``memory_folder=None``, or an
    unusable folder when not ``memory_required``: then one warning says what is lost).

    Appends the names of the run's memory folders of other topologies to ``superseded``
    (never removes them: their job may still run or restart). Raises ``UnsafePathError``
    for a folder that is not ours (never a silent fallback), and what ``MemoryFolder``
    raises when required.
    """
    folder_path = config.memory_folder
    if folder_path is None or not config.enable:
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


def replicas(
    config: InMemoryCkptConfig,
    plan: PairingPlan | None,
    *,
    run_id: str,
    rank: int,
    hsdp: bool,
    backing: ArenaBacking,
) -> tuple[ReplicationChannel | None, PeerReplicas | None]:
    """The replication channel (when the plan pairs ranks) and the peer replicas this rank
    holds (none under HSDP: a replica rank's own slot holds the identical shard)."""
    if plan is None or not plan.has_peer or not config.enable:
        return None, None
    channel = ReplicationChannel(
        plan,
        run_id=run_id,
        rank=rank,
        chunk_bytes=config.replication_chunk_size,
        timeout_s=config.replication_timeout_s,
    )
    if hsdp:
        return channel, None
    peer = PeerReplicas(
        channel, plan, rank=rank, run_id=run_id, pin_memory=config.pin_memory, backing=backing
    )
    return channel, peer


def reattach(
    tier: MemoryTier | None,
    engine: CaptureEngine,
    peer: PeerReplicas | None,
    *,
    rank: int,
    pin: bool,
) -> None:
    """Re-attach to the committed slots an earlier process of this rank left on this node."""
    if tier is None:
        return
    attached, problems = tier.attach(pin=pin)
    for line in problems:
        if "(not_committed)" in line:  # the previous process died mid-capture: routine
            log.info("rank %d: not using a capture the previous process left half-written "
                     "(%s)", rank, line)  # fmt: skip
        else:
            log.warning("rank %d: ignoring %s", rank, line)
    own: list[Adopted] = []
    held: list[Adopted] = []
    for a, handle in attached:
        r = a.record
        adopted = Adopted(a.slot_name, handle, r.layout, r.step, r.state, r.timeline, r.crcs)
        (own if r.identity.role == "own" else held).append(adopted)
    engine.adopt(own)
    if peer is not None:
        peer.adopt(held)
    else:
        for h in held:
            h.handle.release()
    if attached:
        log.info(
            "rank %d: re-attached memory slots: own %s, held %s",
            rank,
            sorted(a.step for a in own),
            sorted(a.step for a in held),
        )


def memory_publisher(tier: MemoryTier) -> Callable[[Lineage, str], None]:
    """A timeline-history publisher: the memory folder records the job's lineage too."""

    def publish(lineage: Lineage, timeline: str) -> None:
        tier.timeline = timeline
        if tier.folder.dir_fd is not None:
            tier.folder.write_lineage(lineage)

    return publish

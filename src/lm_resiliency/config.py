"""Configuration of the in-memory checkpoint tier (GEMINI)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lm_resiliency.errors import ConfigError

MiB = 1024 * 1024
MEMORY_FOLDER_ENV = "LM_RESILIENCY_MEMORY_FOLDER"
DEFAULT_MEMORY_FOLDER = "/dev/shm/lm-resiliency"
RESUME_CHOICES = ("unfinished", "finished")


def default_memory_folder() -> str:
    """``$LM_RESILIENCY_MEMORY_FOLDER`` if set, else ``/dev/shm/lm-resiliency``."""
    return os.environ.get(MEMORY_FOLDER_ENV) or DEFAULT_MEMORY_FOLDER


@dataclass(frozen=True, kw_only=True)
class InMemoryCkptConfig:
    """What GEMINI captures, how often, where it replicates and persists it.

    Every field is validated at construction; a bad value raises
    :class:`~lm_resiliency.errors.ConfigError` naming the field and a valid choice.
    """

    enable: bool = True
    """Master switch; a disabled manager accepts every call and captures nothing."""

    interval: int = 10
    """Capture cadence in optimizer steps when GEMINI runs on its own (>= 1)."""

    replication_jump: int = -1
    """World-rank distance to the peer that holds our replica; ``-1`` = ranks per node."""

    replication_chunk_size: int = 16 * MiB
    """Bytes per replication send (see ``estimate_chunk_size``)."""

    disk_flush_interval: int = 100
    """Persist every this many steps (a multiple of ``interval`` is sensible); ``0`` disables."""

    disk_folder: str | Path = "./checkpoints"
    """Node-local checkpoint directory."""

    run_id: str | None = None
    """Stable identity of this run; ``None`` resolves from the launcher or agrees a fresh one."""

    verify_integrity: bool = False
    """Store a CRC-32C per shard chunk and refuse shards whose checksum fails or is missing."""

    skip_replication_if_hsdp: bool = True
    """Use the natural HSDP replicas instead of explicit peer transfer (two own slots)."""

    pin_memory: bool = True
    """Allocate page-locked host arenas when CUDA is present (faster, asynchronous D2H)."""

    keep_generations: int = 2
    """Node-local generations kept besides the newest recovery-verified one."""

    replication_timeout_s: float = 60.0
    """Bound on every replication wait; a late exchange drops that cycle's replica."""

    signal_flush: bool = True
    """Install SIGTERM/SIGINT handlers that persist the newest complete slots, then chain."""

    signal_flush_deadline_s: float = 25.0
    """Time budget of a signal-triggered flush (keep below the scheduler's grace period)."""

    flush_on_close: bool = False
    """Persist the newest complete slots when the manager is closed normally."""

    copy_rate_limit_bytes_per_s: int | None = None
    """CPU path only: cap the background copy rate to protect foreground compute on few cores."""

    memory_folder: str | Path | None = field(default_factory=default_memory_folder)
    """Node-local memory filesystem (tmpfs) for the slot arenas, so they outlive the process
    and a restarted worker recovers from memory; ``None`` = process memory (lost with it).
    Default ``/dev/shm/lm-resiliency`` (or ``$LM_RESILIENCY_MEMORY_FOLDER``)."""

    memory_required: bool = False
    """Fail (``MemoryFolderFull``) instead of falling back to process memory when the memory
    folder is unusable or too small."""

    keep_memory_on_close: bool = False
    """Keep the memory slots when the manager is closed after a successful run."""

    control_timeout_s: float = 300.0
    """Bound on every agreement collective (identity, availability, recovery); a rank that
    does not answer in time makes every other rank fail, naming it."""

    resume: str = "unfinished"
    """``"unfinished"``: a new launch with this run id resumes it unless it finished;
    ``"finished"``: resume even a finished run (e.g. to train further)."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(
                f"interval={self.interval} is invalid; use a positive number of optimizer "
                "steps between captures, e.g. interval=10"
            )
        if self.replication_jump != -1 and self.replication_jump < 1:
            raise ConfigError(
                f"replication_jump={self.replication_jump} is invalid; use -1 (ranks per node) "
                "or a positive rank distance such as 8"
            )
        if self.replication_chunk_size < 1:
            raise ConfigError(
                f"replication_chunk_size={self.replication_chunk_size} is invalid; use a "
                "positive number of bytes such as 16 * 1024 * 1024 (see estimate_chunk_size)"
            )
        if self.disk_flush_interval < 0:
            raise ConfigError(
                f"disk_flush_interval={self.disk_flush_interval} is invalid; use 0 to disable "
                "periodic flushes or a positive number of steps such as 100"
            )
        if not str(self.disk_folder):
            raise ConfigError(
                "disk_folder is empty; use a node-local directory such as ./checkpoints"
            )
        if self.run_id is not None and (not self.run_id.strip() or "/" in self.run_id):
            raise ConfigError(
                f"run_id={self.run_id!r} is invalid; use a non-empty identifier without '/' "
                "that is the same on every rank, or None to resolve it from the launcher"
            )
        if self.keep_generations < 1:
            raise ConfigError(
                f"keep_generations={self.keep_generations} is invalid; keep at least 1 generation"
            )
        if self.resume not in RESUME_CHOICES:
            raise ConfigError(
                f"resume={self.resume!r} is invalid; use one of {list(RESUME_CHOICES)}"
            )
        if self.memory_folder is not None and not str(self.memory_folder):
            raise ConfigError(
                "memory_folder is empty; use a tmpfs directory such as /dev/shm/lm-resiliency, "
                "or None for process memory"
            )
        for name in ("replication_timeout_s", "signal_flush_deadline_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid; use a positive time")
        limit = self.copy_rate_limit_bytes_per_s
        if limit is not None and limit < MiB:
            raise ConfigError(
                f"copy_rate_limit_bytes_per_s={limit} is invalid; use None (no limit) or at "
                "least 1 MiB/s, e.g. 1_000_000_000"
            )

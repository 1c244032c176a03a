"""Configuration of the in-memory checkpoint tier (GEMINI)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lm_resiliency._validate import Rule, Rules, at_least, positive_time, validate
from lm_resiliency.errors import ConfigError
from lm_resiliency.knobs import REPLICATION_CHUNK_BYTES, REPLICATION_TIMEOUT_S

MiB = 1024 * 1024
MEMORY_FOLDER_ENV = "LM_RESILIENCY_MEMORY_FOLDER"
DEFAULT_MEMORY_FOLDER = "/dev/shm/lm-resiliency"
RESUME_CHOICES = ("unfinished", "finished")


def default_memory_folder() -> str:
    """``$LM_RESILIENCY_MEMORY_FOLDER`` if set, else ``/dev/shm/lm-resiliency`` (as given:
    the CLI's default; the config refuses a relative one, see :func:`_env_memory_folder`)."""
    return os.environ.get(MEMORY_FOLDER_ENV) or DEFAULT_MEMORY_FOLDER


def _env_memory_folder() -> str:
    """:func:`default_memory_folder`, refused with ``ConfigError`` when the variable is a
    relative path: slots would land under the working directory, on disk, not in memory."""
    value = default_memory_folder()
    if not os.path.isabs(value):
        raise ConfigError(
            f"{MEMORY_FOLDER_ENV}={value!r} is not an absolute path (slots would land under "
            "the working directory, on disk); set it to an absolute directory on a memory "
            f"filesystem (tmpfs) such as {DEFAULT_MEMORY_FOLDER}, or unset it"
        )
    return value


def _no_nul(v: str | Path) -> bool:
    return "\0" not in str(v)


@dataclass(frozen=True, kw_only=True)
class InMemoryCkptConfig:
    """What GEMINI captures, how often, where it replicates and persists it.

    Every field is validated at construction, by its annotation (bools are
    bools, ints are ints and not bools, floats are finite, ``disk_folder`` is a
    str or Path) and by its range rule in ``_RULES``; a bad value raises
    :class:`~lm_resiliency.errors.ConfigError` naming the field, the value and
    a valid choice. A new field needs only its annotation (and one ``_RULES``
    line if it has a range).
    """

    enable: bool = True
    """Master switch; a disabled manager accepts every call and captures nothing."""

    interval: int = 10
    """Capture cadence in optimizer steps when GEMINI runs on its own (>= 1)."""

    replication_jump: int = -1
    """World-rank distance to the peer that holds our replica; ``-1`` = ranks per node."""

    replication_chunk_size: int = REPLICATION_CHUNK_BYTES
    """Bytes per replication send (see ``estimate_chunk_size``)."""

    disk_flush_interval: int = 100
    """Persist the captures that reach a multiple of this many steps: with ``interval=5`` and
    ``disk_flush_interval=10`` steps 10, 20, 30, ... (generally the first capture at or after
    each multiple). A persisted step is visible to recovery once its file is published, a few
    hundred ms per GiB after the capture, in the background. ``0`` disables periodic flushes
    (the signal and exit flush, ``flush_newest()`` and ``flush_on_close`` still write)."""

    disk_folder: str | Path = "./checkpoints"
    """Node-local checkpoint directory; it must be writable when anything is persisted
    (``disk_flush_interval``, ``signal_flush`` or ``flush_on_close``)."""

    run_id: str | None = None
    """Stable identity of this run; ``None`` resolves from the launcher or agrees a fresh one."""

    verify_integrity: bool = False
    """Store a CRC-32C per shard chunk and refuse shards whose checksum fails or is missing
    (node-local shards; memory slots are always checksummed and verified)."""

    skip_replication_if_hsdp: bool = True
    """Use the natural HSDP replicas instead of explicit peer transfer (two own slots)."""

    pin_memory: bool = True
    """Allocate page-locked host arenas when CUDA is present (faster, asynchronous D2H)."""

    keep_generations: int = 2
    """Node-local generations kept besides the newest recovery-verified one."""

    replication_timeout_s: float = REPLICATION_TIMEOUT_S
    """Bound on every replication wait; a late exchange drops that cycle's replica."""

    signal_flush: bool = True
    """Install SIGTERM/SIGINT handlers that persist the newest complete slots, then chain."""

    signal_flush_deadline_s: float = 25.0
    """Time budget of a signal-triggered flush (keep below the scheduler's grace period)."""

    flush_on_close: bool = False
    """Persist the newest complete slots when the manager is closed normally."""

    copy_rate_limit_bytes_per_s: int | None = None
    """CPU path only: cap the background copy rate to protect foreground compute on few cores."""

    memory_folder: str | Path | None = field(default_factory=_env_memory_folder)
    """Node-local memory filesystem (tmpfs) for the slot arenas, so they outlive the process
    and a restarted worker recovers from memory; ``None`` = process memory (lost with it).
    Default ``/dev/shm/lm-resiliency`` (or ``$LM_RESILIENCY_MEMORY_FOLDER``). An absolute
    path: a relative one (``Path("")`` is ``.``) is refused."""

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
        validate(self, _RULES)


#: Range rules per field (the type comes from the annotation; see ``lm_resiliency._validate``).
_RULES: dict[str, Rules] = {
    "interval": at_least(
        1,
        "is invalid; use a positive number of optimizer steps between captures, e.g. interval=10",
        "interval=10",
    ),
    "replication_jump": Rule(
        lambda v: v == -1 or v >= 1,
        "is invalid; use -1 (ranks per node) or a positive rank distance such as 8",
        "replication_jump=8",
    ),
    "replication_chunk_size": at_least(
        1,
        "is invalid; use a positive number of bytes such as 16 * 1024 * 1024 "
        "(see estimate_chunk_size)",
        "16 * 1024 * 1024",
    ),
    "disk_flush_interval": at_least(
        0,
        "is invalid; use 0 to disable periodic flushes or a positive number of steps such as 100",
        "disk_flush_interval=100",
    ),
    "disk_folder": (
        Rule(
            lambda v: bool(str(v)),
            "is empty; use a node-local directory such as ./checkpoints",
            'disk_folder="./checkpoints"',
        ),
        Rule(_no_nul, "contains a NUL byte, which no path can hold; remove it"),
    ),
    "run_id": Rule(
        lambda v: bool(v.strip()) and "/" not in v,
        "is invalid; use a non-empty identifier without '/' that is the same on every rank, "
        "or None to resolve it from the launcher",
        'run_id="llama-7b-run-3"',
    ),
    "keep_generations": at_least(1, "is invalid; keep at least 1 generation", "keep_generations=2"),
    "replication_timeout_s": positive_time("60"),
    "signal_flush_deadline_s": positive_time("25"),
    "control_timeout_s": positive_time("300"),
    "resume": Rule(
        lambda v: v in RESUME_CHOICES,
        f"is invalid; use one of {list(RESUME_CHOICES)}",
        'resume="unfinished"',
    ),
    "memory_folder": (
        Rule(
            lambda v: bool(str(v)) and os.path.isabs(v),
            "is not an absolute path (slots would land under the working directory, on disk); "
            "use an absolute directory on a memory filesystem (tmpfs) such as "
            "/dev/shm/lm-resiliency, or None for process memory",
            'memory_folder="/dev/shm/lm-resiliency"',
        ),
        Rule(_no_nul, "contains a NUL byte, which no path can hold; remove it"),
    ),
    "copy_rate_limit_bytes_per_s": at_least(
        MiB,
        "is invalid; use None (no limit) or at least 1 MiB/s, e.g. 1_000_000_000",
        "1_000_000_000",
    ),
}

"""The memory tier of one rank: slot arenas as files that a restarted process re-attaches.

:class:`MemoryTier` is the :class:`~lm_resiliency.capture.slot.ArenaBacking`
of a manager's own and peer slots when ``memory_folder`` is set. Call order
(one rank, not collective)::

    tier = MemoryTier(folder, ...)           # takes the rank folder's lock
    attached, problems = tier.attach()       # committed slots left by an earlier process
    tier.plan(own_bytes)                     # first capture (caller thread): budget check
    ... slots allocate/commit through it ...
    tier.close(remove=True)                  # after a successful run: the files go

When the budget does not fit (or a reservation fails later) the tier falls
back to process memory with one warning saying what is lost (crash
survival), unless ``required``: then it raises :class:`MemoryFolderFull`.
Any "no room" from the filesystem (out of space, out of inodes, over a quota)
takes that same path.

Every slot file carries one CRC-32C per chunk of its arena, computed by the
capture worker (own slots) or verified on receipt (held replicas), never on
the training thread. A re-attached slot is checked against them before it is
used; a mismatch, or a record without them, makes the slot unavailable
(``checksum_mismatch`` / ``checksum_missing``) and recovery moves on to the
next source. ``verify_integrity`` is about node-local shards only.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from lm_resiliency.capture.slot import ANONYMOUS, ArenaHandle, Slot
from lm_resiliency.memory.budget import cgroup_available_bytes, filesystem_free_bytes
from lm_resiliency.memory.folder import Attached, MemoryFolder
from lm_resiliency.memory.slotfile import (
    MemoryFolderFull,
    SlotFile,
    SlotFileState,
    SlotIdentity,
    SlotRecord,
    file_bytes_for,
    full_error,
    is_full,
)

log = logging.getLogger(__name__)

OWN_SLOTS = ("own_0", "own_1")
HELD_SLOTS = ("peer_0", "peer_1")


class _SharedArena:
    """An :class:`ArenaHandle` over a :class:`SlotFile`."""

    survives_process = True

    def __init__(self, tier: MemoryTier, file: SlotFile, slot_name: str) -> None:
        self._tier = tier
        self.file = file
        self.slot_name = slot_name
        self.record: SlotRecord | None = None
        """The record this arena was attached with (restarted process), else ``None``."""

    @property
    def arena(self) -> torch.Tensor:
        return self.file.arena

    def begin(self) -> None:
        self.record = None
        self.file.mark(SlotFileState.WRITING)

    def commit(self, slot: Slot) -> None:
        assert slot.layout is not None and slot.step is not None and slot.document is not None
        assert slot.owner_rank is not None
        tier = self._tier
        if slot.crcs is None:
            raise ValueError(f"memory slot {self.file.where}: sealed without checksums")
        self.file.commit(
            tier.identity(self.slot_name, slot.owner_rank),
            generation=tier.next_generation(),
            step=slot.step,
            # A slot re-protected after a recovery keeps the timeline it was recorded with.
            timeline=slot.timeline if slot.timeline is not None else tier.timeline,
            layout=slot.layout,
            state=slot.document,
            crcs=slot.crcs,
        )

    def retract(self) -> None:
        self.record = None
        self.file.mark(SlotFileState.EMPTY)

    def verify(self) -> None:
        """Check an attached arena against its record's checksums; raise ``SlotUnavailable``.

        Once per attachment: a slot that passed is trusted for the rest of this process.
        """
        if self.record is not None:
            t0 = time.perf_counter()
            self.file.verify(self.record, required=True)
            self._tier.verify_s.append(time.perf_counter() - t0)
            self.record = None

    def hand_over(self) -> torch.Tensor:
        return self.file.hand_over()

    def release(self) -> None:
        self.file.release()

    def discard(self) -> None:
        self.file.remove()


class MemoryTier:
    """Own and held slot files of one rank; falls back to process memory when out of room."""

    def __init__(
        self,
        folder: MemoryFolder,
        *,
        run_id: str,
        topology: str,
        rank: int,
        peer_owner: int | None,
        required: bool,
        slots: int,
    ) -> None:
        self.folder = folder
        self.run_id = run_id
        self.topology = topology
        self.rank = rank
        self.peer_owner = peer_owner
        self.required = required
        self.slots = slots
        self.timeline: str | None = None
        self.verify_s: list[float] = []
        """Seconds checking each re-attached slot against its record's checksums."""
        self.active = True
        self._generation = 0
        self._warned = False

    # -- identity and attachment -----------------------------------------------------

    def identity(self, slot_name: str, owner_rank: int) -> SlotIdentity:
        role = "own" if slot_name.startswith("own") else "held"
        return SlotIdentity(self.run_id, self.topology, self.rank, owner_rank, role)

    def expected(self) -> dict[str, SlotIdentity]:
        names = {s: self.identity(s, self.rank) for s in OWN_SLOTS}
        if self.peer_owner is not None:
            names |= {s: self.identity(s, self.peer_owner) for s in HELD_SLOTS}
        return names

    def attach(self, *, pin: bool = False) -> tuple[list[tuple[Attached, ArenaHandle]], list[str]]:
        """Committed slots an earlier process left here, each with a handle to adopt.

        ``pin`` (CUDA and ``pin_memory``): register each re-attached arena for
        asynchronous device copies, as a freshly allocated one would be.
        """
        found, problems = self.folder.attach(self.expected())
        out: list[tuple[Attached, ArenaHandle]] = []
        for a in found:
            if pin:
                a.file.pin()
            handle = _SharedArena(self, a.file, a.slot_name)
            handle.record = a.record
            self._generation = max(self._generation, a.record.generation)
            out.append((a, handle))
        return out, problems

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    # -- budget and allocation ---------------------------------------------------------

    def plan(self, own_bytes: int) -> None:
        """Check that ``slots`` arenas of ``own_bytes`` fit; fall back (or raise) if not.

        Runs on the caller's thread when the layout is first known, so a strict
        configuration fails from ``save()`` itself.
        """
        if not self.active:
            return
        need = self.slots * file_bytes_for(own_bytes)
        held = self._existing_bytes()
        free = filesystem_free_bytes(self.folder.path)
        problem = None
        if need > free + held:
            problem = f"{free + held} bytes are free on that filesystem"
        else:
            cgroup = cgroup_available_bytes()
            if cgroup is not None and need - held > cgroup:
                problem = f"this process's memory cgroup allows only {cgroup} more bytes"
        if problem is not None:
            self._fall_back(
                f"{self.slots} memory slots of {own_bytes} bytes need {need} bytes in "
                f"{self.folder.root}, but {problem}"
            )

    def _existing_bytes(self) -> int:
        total = 0
        for name in os.listdir(self.folder.dir_fd):
            if name.endswith(".slot"):
                try:
                    total += os.stat(name, dir_fd=self.folder.dir_fd, follow_symlinks=False).st_size
                except OSError:
                    continue
        return total

    def _fall_back(self, why: str) -> None:
        fixes = (
            "give the memory filesystem more room (docker run --shm-size=..., a Kubernetes "
            "emptyDir with medium: Memory and a sizeLimit), point memory_folder= at a larger "
            "tmpfs, or set memory_folder=None to use process memory without this check"
        )
        if self.required:
            raise MemoryFolderFull(f"{why}; memory_required=True. Fix: {fixes}")
        self.active = False
        if not self._warned:
            self._warned = True
            log.warning(
                "rank %d: %s. The in-memory checkpoints now live in process memory and are "
                "LOST when this process dies (no restart recovery from memory; peers and disk "
                "still serve). Fix: %s",
                self.rank,
                why,
                fixes,
            )

    def allocate(self, slot_name: str, nbytes: int, *, pin: bool) -> ArenaHandle:
        """A slot file for ``slot_name`` (process memory once the tier fell back)."""
        if self.active:
            try:
                file = self.folder.create(slot_name, nbytes)
            except MemoryFolderFull as exc:
                self._fall_back(str(exc))
            except OSError as exc:  # "no room" from any other step: the same fallback
                if not is_full(exc):
                    raise
                self._fall_back(str(full_error(exc, "a memory slot", str(self.folder.path))))
            else:
                if pin:
                    file.pin()
                return _SharedArena(self, file, slot_name)
        return ANONYMOUS.allocate(slot_name, nbytes, pin=pin)

    @property
    def survives_process(self) -> bool:
        return self.active

    def close(self, *, remove: bool) -> None:
        """Release the folder; with ``remove`` delete every slot file (a successful run)."""
        if remove:
            self.folder.remove_all()
        else:
            self.folder.close()

"""Which generations to keep, and a pool of retired files to overwrite next.

Policy, per owner rank: keep the newest ``keep`` persisted steps plus the
newest recovery-verified step and every candidate newer than it; everything
else goes. Any of those candidates can be the step SCOUT promotes next (it
verifies candidates oldest first, once every recipe was checked clean since),
and this rank's view of the promotions can lag the others' (the trust worker
records them in the background, and an owner's generations are also retained
by the rank holding its replica in the same folder). Keeping only the oldest
pending candidate let two views of one owner remove between them every step
that became verified (a 4-rank rotation run ended with no verified step on
every rank). The pending candidates are bounded by the rotation: a candidate
is promoted or rejected within K checks of K recipes. Retention runs only right
after a new generation of that owner was published on this node, so there are
never fewer than ``keep`` complete generations of an owner once ``keep`` have
been written.

Retired files are not always deleted: deleting a large file costs time
(measured here: ~240 ms for 1 GiB), and overwriting an existing file in place
is much faster than filling a new one (no block allocation). A retired file is
therefore renamed to a hidden temp name of our scope and handed to the next
write as its temp file. The peak disk use is unchanged (``keep`` generations
plus one file, as during any write); a spare left by a process that died is a
stale temp of its scope and is reaped like any other.

Only a file we alone hold is ever parked: a regular file of ours with one
link (a second link is a ``cp -al`` / ``rsync --link-dest`` backup, or a link
planted to a file outside the folder, and overwriting it would change that
file). Its device and inode are recorded, and the writer checks them (and the
link count, again) on the open descriptor before it overwrites anything; see
:func:`lm_resiliency.persistence.publish.publish`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lm_resiliency._safefs import judge
from lm_resiliency._tempnames import temp_name

#: Spares kept per store: one per owner it usually writes (its own and one peer's).
MAX_SPARES = 2


def plan_retention(
    steps: Sequence[int],
    *,
    keep: int,
    verified_step: int | None,
    candidates: Sequence[int] = (),
) -> list[int]:
    """Steps to remove (ascending): all but the newest ``keep``, ``verified_step`` and
    ``candidates`` (those pending newer than it, see :func:`pending_candidates`)."""
    assert keep >= 1, keep
    ordered = sorted(set(steps))
    kept = set(ordered[-keep:]) | set(candidates)
    if verified_step is not None:
        kept.add(verified_step)
    return [s for s in ordered if s not in kept]


def pending_candidates(
    steps: Sequence[int], verified_step: int | None, is_candidate: Callable[[int], bool]
) -> list[int]:
    """Those of ``steps`` newer than ``verified_step`` for which ``is_candidate`` holds."""
    return [
        step
        for step in sorted(set(steps))
        if (verified_step is None or step > verified_step) and is_candidate(step)
    ]


def newest_verified(steps: Sequence[int], is_verified: Callable[[int], bool]) -> int | None:
    """The newest of ``steps`` for which ``is_verified`` holds, asking newest first."""
    for step in sorted(set(steps), reverse=True):
        if is_verified(step):
            return step
    return None


@dataclass(frozen=True)
class Spare:
    """A parked file: its temp name and what it was when we parked it."""

    name: str
    size_bytes: int
    identity: tuple[int, int]
    """``(st_dev, st_ino)``: the writer overwrites only this very file."""


class SparePool:
    """Retired files parked in one directory, to be overwritten by the next write.

    Thread-safe. ``names`` is shared with the store's finalizer so spares are
    removed when the store is closed or garbage-collected.
    """

    def __init__(self, limit: int = MAX_SPARES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self.names: dict[str, Spare] = {}

    def park(self, src_dir_fd: int, name: str, spare_dir_fd: int, *, where: str = "") -> bool:
        """Move ``name`` into the pool if there is room and it is ours alone.

        ``False`` means: delete it instead (unlinking drops only our link, so a
        hard-linked backup or outside file survives). Parked are only regular
        files owned by us, not writable by others, with exactly one link.

        A file that vanishes on the way was retired by another rank sharing this
        folder (an owner and the holder of its replica on one node both retain
        that owner's generations): ``False`` too, and the caller's unlink finds
        nothing left to do.
        """
        with self._lock:
            if len(self.names) >= self._limit:
                return False
            try:
                st = os.stat(name, dir_fd=src_dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if judge(st, where or name, expect="file") is not None or st.st_nlink != 1:
                return False
            spare = temp_name("spare")
            try:
                os.rename(name, spare, src_dir_fd=src_dir_fd, dst_dir_fd=spare_dir_fd)
            except FileNotFoundError:
                return False
            self.names[spare] = Spare(spare, st.st_size, (st.st_dev, st.st_ino))
            return True

    def take(self, want_bytes: int) -> Spare | None:
        """The spare that fits ``want_bytes`` best (smallest large enough, else largest).

        Never waits: a signal-time flush must not block on a lock the
        interrupted main thread may hold; a busy pool just means a new file.
        """
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if not self.names:
                return None
            spares = list(self.names.values())
            fits = [s for s in spares if s.size_bytes >= want_bytes]
            if fits:
                spare = min(fits, key=lambda s: s.size_bytes)
            else:
                spare = max(spares, key=lambda s: s.size_bytes)
            del self.names[spare.name]
            return spare
        finally:
            self._lock.release()

    def drop_all(self, spare_dir_fd: int) -> None:
        """Delete every parked spare (at close)."""
        with self._lock:
            for name in list(self.names):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=spare_dir_fd)
                del self.names[name]

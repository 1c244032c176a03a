"""The manager's side of timelines: agree the lineage, commit where this job came from, finish.

Call order (every rank; ``agree`` is collective)::

    history = History.agree(local_lineages, control=..., run_id=..., resume=...)
    history.eligible(step, timeline)      # recovery and retention filter
    history.commit(parent, fork_step)     # once: after load(), a fallback or the first save
    history.finish(step)                  # close() after a successful run

See :mod:`lm_resiliency.persistence.lineage` for what a timeline is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from lm_resiliency.control import ControlPlane
from lm_resiliency.persistence.lineage import Lineage, Timeline, merge

log = logging.getLogger(__name__)

Publish = Callable[[Lineage, str], None]
"""Writes the lineage (and the current timeline id) wherever this rank keeps copies."""


class History:
    """The lineage this job continues and the new timeline it writes."""

    def __init__(
        self, lineage: Lineage, timeline: str, *, finished: Timeline | None, rank: int
    ) -> None:
        self.lineage = lineage
        self.timeline = timeline
        """The id recorded in every generation this manager writes."""
        self.finished = finished
        """The head timeline when it finished and resuming it was not asked for."""
        self.committed = False
        self.rank = rank
        self._publishers: list[Publish] = []

    @classmethod
    def agree(
        cls,
        local: Sequence[Lineage | None],
        *,
        control: ControlPlane,
        run_id: str,
        resume: str,
    ) -> History:
        """Collective: the job's lineage (the longest any rank knows) and a new timeline id."""
        mine, _ = merge([lin for lin in local if lin is not None])
        fresh = os.urandom(8).hex()
        gathered = control.all_gather_bytes(
            fresh.encode() + b"|" + mine.encode(), name="agree the run's timelines"
        )
        lineages = []
        for blob in gathered:
            _, _, body = blob.partition(b"|")
            try:
                lineages.append(Lineage.decode(body, run_id=run_id))
            except ValueError:
                lineages.append(Lineage())
        job, consistent = merge(lineages)
        heads = {lin.head for lin in lineages if lin.head is not None}
        if job.head is not None and any(
            h.id == job.head.id and h.finished_step is None for h in heads
        ):
            job = job.with_finished(None)  # finished only where every rank finished it
        if not consistent and control.rank == 0:
            log.warning(
                "ranks remember different timelines of run %s; continuing the longest history "
                "(%d timelines)",
                run_id,
                len(job.timelines),
            )
        timeline = gathered[0].partition(b"|")[0].decode()
        head = job.head
        finished = None
        if head is not None and head.finished_step is not None and resume != "finished":
            finished = head
            if control.rank == 0:
                log.warning(
                    "run %s finished at step %s; a new launch with the same run id does not "
                    "resume it (pass resume='finished' to continue it, or use a new run_id)",
                    run_id,
                    head.finished_step,
                )
        return cls(job, timeline, finished=finished, rank=control.rank)

    def add_publisher(self, publish: Publish) -> None:
        self._publishers.append(publish)
        if self.committed:
            publish(self.lineage, self.timeline)

    def eligible(self, step: int, timeline: str | None) -> bool:
        """Whether recovery may choose a generation of ``timeline`` at ``step``."""
        if self.committed:
            return self.lineage.eligible(step, timeline)
        if self.finished is not None:
            return False
        return self.lineage.eligible(step, timeline)

    def commit(self, parent: str | None, fork_step: int | None, *, replace: bool = False) -> None:
        """Record where this job's timeline came from (once; later calls do nothing).

        ``replace``: this timeline has written nothing yet, so a later recovery
        (say, of an older verified step after the latest one was applied) may
        still say where it really forked.
        """
        if self.committed and not replace:
            return
        if parent is None:
            fork_step = None
        entry = Timeline(self.timeline, parent, fork_step)
        self.lineage = self.lineage.with_timeline(entry)
        self.committed = True
        self._publish()

    def finish(self, step: int | None) -> None:
        """Mark this job's timeline finished at ``step`` (a successful end of training)."""
        if not self.committed:
            self.commit(None, None)
        self.lineage = self.lineage.with_finished(step)
        self._publish()

    def _publish(self) -> None:
        for publish in self._publishers:
            try:
                publish(self.lineage, self.timeline)
            except OSError as exc:  # a copy that cannot be written narrows nothing
                log.warning("rank %d: could not record the run's timelines: %s", self.rank, exc)

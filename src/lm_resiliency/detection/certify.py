"""Certification: which captured steps become CANDIDATE or RECOVERY_VERIFIED, and rejection.

The rules of docs/scout.md ("Certification"), applied identically on every rank
(each rank decides from the same all-gathered reports, so decisions are job-wide):

* dense catalogs: a rotation over blocks of different signatures is K recipes
  (:mod:`~lm_resiliency.detection.coverage`). A capture is a ``CANDIDATE``
  (persisted, excluded from verified recovery) until every recipe was checked
  clean at or after its step; then it is ``RECOVERY_VERIFIED``. With one
  signature, or every recipe replayed at the check, that is at once (K = 1);
* dynamic catalogs: the capture after the first complete accepted cycle is the
  cycle ``CANDIDATE`` (persisted, and the caller's durable-candidate callback
  runs); after the next complete accepted cycle it becomes ``RECOVERY_VERIFIED``
  (once the dense recipes also cover it; ``on_verified`` runs for a durable one)
  and the new capture the next candidate;
* SDC or inconclusive anywhere: the capture is skipped, every candidate is
  rejected (``on_rejected`` runs for each durable one), the previous verified
  generation is kept, and the verdict "recover in verified mode" is persisted.
  SCOUT then stays *latched* (no further capture is allowed or certified) until
  a verified recovery, because under DDP a rank that computed wrongly has
  already poisoned every replica's update: a later clean check would otherwise
  certify corrupted state.

Every trust change goes through :class:`TrustSink` (the GEMINI manager's ``trust``), whose
methods return at once and persist in the background.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

from lm_resiliency.persistence.trust import RecoveryVerdict, TrustStatus

log = logging.getLogger(__name__)


class TrustSink(Protocol):
    """What certification needs from GEMINI (``InMemoryCheckpointManager.trust`` provides it)."""

    def certify(self, step: int, trust: TrustStatus, *, persist: bool = True) -> None: ...

    def reject(self, step: int, *, reason: str) -> None: ...

    def require_verified_recovery(self, step: int, *, reason: str) -> None: ...

    def clear_recovery_verdict(self) -> None: ...

    def recovery_verdict(self) -> RecoveryVerdict | None: ...


class Certifier:
    """One rank's certification state; see the module docstring for the rules.

    ``frontier`` arguments come from :meth:`Coverage.frontier
    <lm_resiliency.detection.coverage.Coverage.frontier>`: the newest step every
    dense recipe was checked clean at or after.

    ``on_candidate(step)`` writes the framework's durable candidate of a cycle's
    ``CANDIDATE``; ``on_verified(step)`` / ``on_rejected(step)`` tell that writer the
    fate of a step it wrote (never of another), on the training thread, every rank at
    the same check. A durable candidate dropped by a recovery (its timeline abandoned)
    hears neither and stays a candidate.
    """

    def __init__(
        self,
        sink: TrustSink | None,
        *,
        dynamic: bool,
        persist: bool,
        on_candidate: Callable[[int], None] | None = None,
        on_verified: Callable[[int], None] | None = None,
        on_rejected: Callable[[int], None] | None = None,
    ) -> None:
        self.sink = sink
        self.dynamic = dynamic
        self.persist = persist
        self.on_candidate = on_candidate
        self.on_verified = on_verified
        self.on_rejected = on_rejected
        self._durable: set[int] = set()
        """Steps given to ``on_candidate`` whose fate was not told yet."""
        self.candidate: int | None = None
        """The dynamic cycle's candidate (awaiting the next complete cycle)."""
        self.pending: list[int] = []
        """Persisted candidates awaiting recipe coverage, oldest first."""
        self.verified: int | None = None
        self.rejected: list[tuple[int, str]] = []
        self.latched: str | None = None
        """Why captures are blocked (an SDC was seen), or ``None``."""
        self.cycle_complete = False
        """A complete accepted cycle awaits the next capture (dynamic catalogs)."""
        self._clear_verdict = False

    def observe(
        self,
        step: int,
        *,
        corrupt: bool,
        reason: str,
        cycle_complete: bool,
        frontier: float = math.inf,
    ) -> None:
        """Apply one check's job-wide outcome (call on every rank after every check)."""
        if corrupt:
            self._on_sdc(step, reason)
            return
        if cycle_complete and self.latched is None:
            self.cycle_complete = True
        self.advance(frontier)

    def advance(self, frontier: float) -> None:
        """Promote every pending candidate at or before ``frontier`` to RECOVERY_VERIFIED."""
        if self.latched is not None or not self.pending or self.pending[0] > frontier:
            return
        ready = [s for s in self.pending if s <= frontier]
        self.pending = [s for s in self.pending if s > frontier]
        for step in ready:
            if self.sink is not None:
                self.sink.certify(step, TrustStatus.RECOVERY_VERIFIED, persist=False)
            self._tell(step, self.on_verified)
        self.verified = ready[-1]
        log.info("SCOUT: step(s) %s verified (every recipe checked clean since)", ready)

    def _on_sdc(self, step: int, reason: str) -> None:
        self.cycle_complete = False
        if self.latched is not None:
            return
        self.latched = f"SDC found at step {step}: {reason}"
        doomed = [*self.pending, *([] if self.candidate is None else [self.candidate])]
        for cand in sorted(doomed):
            self.rejected.append((cand, reason))
            if self.sink is not None:
                self.sink.reject(cand, reason=f"SCOUT at step {step}: {reason}")
            self._tell(cand, self.on_rejected)
        if doomed:
            log.warning("SCOUT rejected candidate step(s) %s: %s", sorted(doomed), reason)
        self.candidate = None
        self.pending = []
        self._clear_verdict = False
        if self.sink is not None:
            self.sink.require_verified_recovery(step, reason=reason)

    def captured(self, step: int, *, frontier: float = math.inf) -> TrustStatus:
        """Certify the capture just taken at ``step`` (accepted check); returns its trust."""
        if self.latched is not None:
            return TrustStatus.UNVERIFIED
        sink = self.sink
        if self._clear_verdict and sink is not None:
            sink.clear_recovery_verdict()
            self._clear_verdict = False
        if not self.dynamic:
            self.advance(frontier)
            if step <= frontier:
                self.verified = step
                if sink is not None:
                    sink.certify(step, TrustStatus.RECOVERY_VERIFIED, persist=self.persist)
                return TrustStatus.RECOVERY_VERIFIED
            self.pending.append(step)
            if sink is not None:
                sink.certify(step, TrustStatus.CANDIDATE, persist=self.persist)
            return TrustStatus.CANDIDATE
        if not self.cycle_complete:
            return TrustStatus.UNVERIFIED
        self.cycle_complete = False
        if self.candidate is not None:
            self.pending.append(self.candidate)  # its second cycle is complete
            self.advance(frontier)
        self.candidate = step
        if sink is not None:
            sink.certify(step, TrustStatus.CANDIDATE, persist=self.persist)
        if self.on_candidate is not None:
            self.on_candidate(step)
            self._durable.add(step)
        return TrustStatus.CANDIDATE

    def _tell(self, step: int, hook: Callable[[int], None] | None) -> None:
        """Tell the durable-candidate writer the fate of ``step`` (once; only steps it wrote)."""
        if step in self._durable:
            self._durable.discard(step)
            if hook is not None:
                hook(step)

    def recovered(self, step: int, *, verified: bool) -> None:
        """The state of ``step`` was restored (verified: unlatch; clear the verdict later).

        Candidates newer than ``step`` belong to the abandoned timeline and are dropped.
        """
        self.pending = [s for s in self.pending if s <= step]
        if self.candidate is not None and self.candidate > step:
            self.candidate = None
        if verified:
            self.verified = step  # the newest verified step of the timeline that continues
            self.latched = None
            self.cycle_complete = False
            self.candidate = None
            self.pending = []
            self._clear_verdict = True
        # A durable candidate no longer pending stays a candidate on disk: never loaded.
        self._durable &= {*self.pending, *([] if self.candidate is None else [self.candidate])}
        if not verified and self.latched is not None:
            log.warning(
                "SCOUT stays latched (%s): the state restored was not verified", self.latched
            )

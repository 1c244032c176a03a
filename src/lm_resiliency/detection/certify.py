"""Certification: which captured steps become CANDIDATE or RECOVERY_VERIFIED, and rejection.

The contract's rules, applied identically on every rank (each rank decides from
the same all-gathered reports, so decisions are job-wide):

* dense catalogs (K = 1): a capture taken after an accepted check is
  ``RECOVERY_VERIFIED`` at once;
* dynamic catalogs: the capture after the first complete accepted cycle is the
  ``CANDIDATE`` (persisted, and the caller's durable-candidate callback runs);
  after the next complete accepted cycle that candidate becomes
  ``RECOVERY_VERIFIED`` and the new capture the next candidate;
* SDC or inconclusive anywhere: the capture is skipped, the current candidate is
  rejected, the previous verified generation is kept, and the verdict "recover in
  verified mode" is persisted. SCOUT then stays *latched* (no further capture is
  allowed or certified) until a verified recovery, because under DDP a rank that
  computed wrongly has already poisoned every replica's update: a later clean
  check would otherwise certify corrupted state.

Every trust change goes through :class:`TrustSink` (the GEMINI manager's ``trust``), whose
methods return at once and persist in the background.
"""

from __future__ import annotations

import logging
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
    """One rank's certification state; see the module docstring for the rules."""

    def __init__(
        self,
        sink: TrustSink | None,
        *,
        dynamic: bool,
        persist: bool,
        on_candidate: Callable[[int], None] | None = None,
    ) -> None:
        self.sink = sink
        self.dynamic = dynamic
        self.persist = persist
        self.on_candidate = on_candidate
        self.candidate: int | None = None
        self.verified: int | None = None
        self.rejected: list[tuple[int, str]] = []
        self.latched: str | None = None
        """Why captures are blocked (an SDC was seen), or ``None``."""
        self.cycle_complete = False
        """A complete accepted cycle awaits the next capture (dynamic catalogs)."""
        self._clear_verdict = False

    def observe(self, step: int, *, corrupt: bool, reason: str, cycle_complete: bool) -> None:
        """Apply one check's job-wide outcome (call on every rank after every check)."""
        if corrupt:
            self._on_sdc(step, reason)
        elif cycle_complete and self.latched is None:
            self.cycle_complete = True

    def _on_sdc(self, step: int, reason: str) -> None:
        self.cycle_complete = False
        if self.latched is not None:
            return
        self.latched = f"SDC found at step {step}: {reason}"
        if self.candidate is not None:
            self.rejected.append((self.candidate, reason))
            if self.sink is not None:
                self.sink.reject(self.candidate, reason=f"SCOUT at step {step}: {reason}")
            log.warning("SCOUT rejected candidate step %d: %s", self.candidate, reason)
            self.candidate = None
        self._clear_verdict = False
        if self.sink is not None:
            self.sink.require_verified_recovery(step, reason=reason)

    def captured(self, step: int) -> TrustStatus:
        """Certify the capture just taken at ``step`` (accepted check); returns its trust."""
        if self.latched is not None:
            return TrustStatus.UNVERIFIED
        sink = self.sink
        if self._clear_verdict and sink is not None:
            sink.clear_recovery_verdict()
            self._clear_verdict = False
        if not self.dynamic:
            self.verified = step
            if sink is not None:
                sink.certify(step, TrustStatus.RECOVERY_VERIFIED, persist=self.persist)
            return TrustStatus.RECOVERY_VERIFIED
        if not self.cycle_complete:
            return TrustStatus.UNVERIFIED
        self.cycle_complete = False
        if self.candidate is not None:
            self.verified = self.candidate
            if sink is not None:
                sink.certify(self.candidate, TrustStatus.RECOVERY_VERIFIED, persist=False)
        self.candidate = step
        if sink is not None:
            sink.certify(step, TrustStatus.CANDIDATE, persist=self.persist)
        if self.on_candidate is not None:
            self.on_candidate(step)
        return TrustStatus.CANDIDATE

    def recovered(self, *, verified: bool) -> None:
        """The state of a verified step was restored (unlatch; clear the verdict later)."""
        if verified:
            self.latched = None
            self.cycle_complete = False
            self.candidate = None
            self._clear_verdict = True
        elif self.latched is not None:
            log.warning(
                "SCOUT stays latched (%s): the state restored was not verified", self.latched
            )

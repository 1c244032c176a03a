"""GEMINI node-local persistence: format-v3 shards, identity, sidecars, retention, signal flush.

Entry points: :class:`ShardStore` (one per rank), :func:`resolve_run_id` and
:func:`agree_job_fingerprint` (collective, at manager construction),
:func:`install_flush_on_signal` (main thread). File format:
:mod:`lm_resiliency.persistence.format`; folder layout:
:mod:`lm_resiliency.persistence.namespace`.
"""

from __future__ import annotations

from lm_resiliency.persistence.identity import (
    agree_job_fingerprint,
    job_fingerprint,
    resolve_run_id,
    topology_fingerprint,
)
from lm_resiliency.persistence.reader import ShardReader
from lm_resiliency.persistence.reasons import UnavailableReason
from lm_resiliency.persistence.sidecar import SidecarStatus
from lm_resiliency.persistence.signals import SignalFlush, install_flush_on_signal
from lm_resiliency.persistence.store import LoadedShard, ShardStore
from lm_resiliency.persistence.trust import RecoveryVerdict, TrustStatus

__all__ = [
    "LoadedShard",
    "RecoveryVerdict",
    "ShardReader",
    "ShardStore",
    "SidecarStatus",
    "SignalFlush",
    "TrustStatus",
    "UnavailableReason",
    "agree_job_fingerprint",
    "install_flush_on_signal",
    "job_fingerprint",
    "resolve_run_id",
    "topology_fingerprint",
]

"""MTGS step transactions: vote in the gradient all-reduce, atomic commit or abort, rollback, retry.

``MTGS(ddp_model, optimizer, scheduler, config=MTGSConfig(...)).step(closure)``
runs one training step that every rank commits or every rank discards; see
:mod:`lm_resiliency.transactions.transaction` for the protocol and
``docs/mtgs.md`` for the design.
"""

from __future__ import annotations

from lm_resiliency.rng import RngState
from lm_resiliency.transactions.hook import MTGSState, mtgs_comm_hook
from lm_resiliency.transactions.mtgs_config import ExhaustedPolicy, MTGSConfig
from lm_resiliency.transactions.reasons import AbortReason, describe, reason_names
from lm_resiliency.transactions.result import AbortRecord, StepResult
from lm_resiliency.transactions.sampler import ShardedSampler
from lm_resiliency.transactions.shadow import Shadow
from lm_resiliency.transactions.tracer import Tracer, merge_traces
from lm_resiliency.transactions.transaction import MTGS, HealthCheck, Stateful

__all__ = [
    "MTGS",
    "AbortReason",
    "AbortRecord",
    "ExhaustedPolicy",
    "HealthCheck",
    "MTGSConfig",
    "MTGSState",
    "RngState",
    "Shadow",
    "ShardedSampler",
    "Stateful",
    "StepResult",
    "Tracer",
    "describe",
    "merge_traces",
    "mtgs_comm_hook",
    "reason_names",
]

"""Fault injection for tests, demos and benchmarks (guarded: opt-in per process)."""

from __future__ import annotations

from lm_resiliency.faults.compute import (
    BitFlip,
    ComputeFault,
    ComputeFaults,
    PersistentSDC,
    SlowRank,
    flip_bit,
)
from lm_resiliency.faults.injector import ARM_ENV, FaultInjector, FiredFault, InjectedFaultError
from lm_resiliency.faults.schedule import Fault, FaultKind, FaultSchedule

__all__ = [
    "ARM_ENV",
    "BitFlip",
    "ComputeFault",
    "ComputeFaults",
    "Fault",
    "FaultInjector",
    "FaultKind",
    "FaultSchedule",
    "FiredFault",
    "InjectedFaultError",
    "PersistentSDC",
    "SlowRank",
    "flip_bit",
]

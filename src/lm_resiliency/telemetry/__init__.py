"""Telemetry: recovery timing (ETTR), structured JSONL events, throughput."""

from __future__ import annotations

from lm_resiliency.telemetry.ettr import EttrTimer, RecoveryEvent, read_csv, read_jsonl
from lm_resiliency.telemetry.events import EventLog, read_events
from lm_resiliency.telemetry.throughput import ThroughputMeter

__all__ = [
    "EttrTimer",
    "EventLog",
    "RecoveryEvent",
    "ThroughputMeter",
    "read_csv",
    "read_events",
    "read_jsonl",
]

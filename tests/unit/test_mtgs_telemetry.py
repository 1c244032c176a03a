"""ETTR timer export, the JSONL event log, the throughput meter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_resiliency.telemetry import (
    EttrTimer,
    EventLog,
    RecoveryEvent,
    ThroughputMeter,
    read_csv,
    read_events,
    read_jsonl,
)


def _timer() -> EttrTimer:
    timer = EttrTimer(rank=3)
    start = timer.now()
    timer.record("abort", step=2, attempt=0, detected_ns=start, reasons="rank 1: nonfinite_grad")
    start = timer.now()
    timer.record("rollback", step=5, attempt=1, detected_ns=start, restored_bytes=4096)
    return timer


def test_events_carry_rank_step_and_a_nonnegative_duration() -> None:
    timer = _timer()
    assert [(e.kind, e.step, e.attempt, e.rank) for e in timer.events] == [
        ("abort", 2, 0, 3),
        ("rollback", 5, 1, 3),
    ]
    assert all(e.duration_ns >= 0 for e in timer.events)
    assert timer.durations_ns("rollback") == [timer.events[1].duration_ns]
    assert timer.median_ns("abort") == timer.events[0].duration_ns
    assert EttrTimer().median_ns() is None


def test_csv_and_jsonl_exports_round_trip(tmp_path: Path) -> None:
    timer = _timer()
    assert read_csv(timer.to_csv(tmp_path / "ettr.csv")) == timer.events
    assert read_jsonl(timer.to_jsonl(tmp_path / "ettr.jsonl")) == timer.events
    header = (tmp_path / "ettr.csv").read_text().splitlines()[0]
    assert header.split(",")[-1] == "duration_ns"
    first = json.loads((tmp_path / "ettr.jsonl").read_text().splitlines()[0])
    assert first["duration_ns"] == timer.events[0].duration_ns
    assert first["reasons"] == "rank 1: nonfinite_grad"


def test_recovery_event_duration_is_ready_minus_detected() -> None:
    assert RecoveryEvent("abort", 1, 0, 0, detected_ns=100, ready_ns=350).duration_ns == 250


def test_event_log_writes_one_json_object_per_line(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "sub" / "events.jsonl", rank=2)
    log.log("mtgs.abort", step=3, reasons="rank 1: forced")
    log.log("mtgs.commit", step=3, attempts=2)
    log.close()
    records = read_events(tmp_path / "sub" / "events.jsonl")
    assert [(r["event"], r["rank"], r["step"]) for r in records] == [
        ("mtgs.abort", 2, 3),
        ("mtgs.commit", 2, 3),
    ]
    assert all(isinstance(r["ts_ns"], int) for r in records)
    assert records == log.records


def test_event_log_rejects_values_json_cannot_carry() -> None:
    log = EventLog(rank=0)
    with pytest.raises(TypeError):
        log.log("bad", value=object())
    with pytest.raises(ValueError):
        log.log("bad", value=float("nan"))
    assert log.records == []


def test_throughput_meter_excludes_warmup_intervals() -> None:
    meter = ThroughputMeter(warmup_steps=1)
    with pytest.raises(RuntimeError, match="before start"):
        meter.step(10)
    meter.start()
    for tokens in (1000, 200, 300):
        meter.step(tokens)
    assert meter.steps == 3
    assert meter.tokens == 500
    assert meter.tokens_per_s > 0
    assert len(meter.rates) == 3
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        ThroughputMeter(warmup_steps=-1)

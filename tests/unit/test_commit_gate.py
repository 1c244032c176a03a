"""The capture engine's commit gate (SCOUT's held capture), on a real engine and worker."""

from __future__ import annotations

import threading

import torch

from lm_resiliency.capture.engine import CaptureEngine
from lm_resiliency.capture.gate import CommitGate


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), v)}


def _steps(engine: CaptureEngine) -> list[int | None]:
    return [s.step for s in engine.complete_slots()]


def test_a_held_capture_is_invisible_until_accepted_then_committed() -> None:
    engine = CaptureEngine(pin_memory=False)
    try:
        engine.capture(_state(1.0), 1)
        engine.wait_idle()
        decided: list[bool] = []
        gate = CommitGate(2, lambda: decided.append(True) or gate.decide(True))
        engine.capture(_state(2.0), 2, gate=gate)
        engine.wait_captured()  # the bytes are copied: returns while the verdict is pending
        assert not gate.decided and _steps(engine) == [1]  # held: not visible
        engine.wait_idle()  # a wait that needs the cycle resolves the gate on this thread
        assert decided == [True] and _steps(engine) == [2, 1]
    finally:
        engine.close()


def test_a_refused_capture_is_discarded_and_the_previous_kept() -> None:
    engine = CaptureEngine(pin_memory=False)
    try:
        engine.capture(_state(1.0), 1)
        gate = CommitGate(2, lambda: gate.decide(False, "sdc"))
        engine.capture(_state(2.0), 2, gate=gate)
        engine.wait_captured()
        engine.capture(_state(3.0), 3)  # the next capture resolves the held one first
        engine.wait_idle()
        assert engine.stats.discarded == 1 and _steps(engine) == [3, 1]
    finally:
        engine.close()


def test_a_resolver_that_decides_nothing_discards_instead_of_waiting() -> None:
    engine = CaptureEngine(pin_memory=False)
    try:
        gate = CommitGate(1, lambda: None)
        engine.capture(_state(1.0), 1, gate=gate)
        engine.wait_idle()
        assert gate.accepted is False and engine.stats.discarded == 1 and _steps(engine) == []
    finally:
        engine.close()


def test_close_with_an_undecided_gate_drops_it_without_resolving() -> None:
    engine = CaptureEngine(pin_memory=False)
    called = threading.Event()
    gate = CommitGate(1, called.set)
    engine.capture(_state(1.0), 1, gate=gate)
    engine.wait_captured()
    engine.close()  # the exit path: never a collective, never a wait on nobody
    assert not called.is_set() and gate.accepted is False and engine.stats.discarded == 1


def test_decision_listeners_run_once_with_the_first_decision() -> None:
    """The front door counts a discarded held capture as skipped through ``on_decided``."""
    seen: list[bool] = []
    gate = CommitGate(4, lambda: gate.decide(False, "sdc"))
    gate.on_decided(seen.append)
    assert seen == []  # undecided: nothing yet
    gate.resolve()
    gate.decide(True)  # ignored: the first decision wins, listeners are not called again
    gate.on_decided(seen.append)  # already decided: called at once with the decision
    assert seen == [False, False] and gate.accepted is False

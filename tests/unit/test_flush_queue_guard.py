"""A slot queued for its disk write is not overwritten before the write.

The writer thread persists one slot at a time; the others wait in its queue.
A capture rotating onto a queued slot used to replace its step before the
writer reached it: the write then found another step, logged it at INFO and
the step never reached the disk (seen as a flake of
``test_trust_report_shows_each_generation_as_inspect_would`` under load).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from lm_resiliency.capture import Layout
from lm_resiliency.capture.slot import Slot
from lm_resiliency.checkpointing.flush import DiskFlusher
from lm_resiliency.persistence import ShardStore, TrustStatus

torch.set_num_threads(1)


def _fill(slot: Slot, step: int) -> None:
    layout = Layout.from_tensors([torch.empty(64, dtype=torch.int32)], ["w"])
    slot.prepare(layout, pin=False)
    slot.views()[0].fill_(step)
    slot.publish(step, {"step": step}, owner_rank=0)
    slot.seal(None)


class _GatedStore(ShardStore):
    """A real store whose first write waits until the test opens the gate."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, **kw):  # type: ignore[no-untyped-def,override]
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().write(**kw)


def test_a_capture_rotating_onto_a_queued_slot_waits_for_its_write(tmp_path: Path) -> None:
    store = _GatedStore(tmp_path, run_id="r", topology="t", rank=0, verify_integrity=True)
    flusher = DiskFlusher(lambda: store, trust=lambda step: TrustStatus.UNVERIFIED)
    a, b = Slot("a"), Slot("b")
    try:
        _fill(a, 0)
        flusher.submit([a])
        assert store.entered.wait(10)  # the writer is busy with step 0 ...
        _fill(b, 1)
        flusher.submit([b])  # ... so step 1 waits in the queue

        rotated = threading.Event()

        def next_capture() -> None:  # what the capture worker does with the oldest slot
            _fill(b, 3)
            rotated.set()

        t = threading.Thread(target=next_capture, daemon=True)
        t.start()
        assert not rotated.wait(0.5), "the capture overwrote a slot whose write was queued"
        store.gate.set()
        assert flusher.wait_idle(30)
        t.join(10)
        assert rotated.is_set()
        assert b.step == 3
        assert store.steps(0) == [0, 1]
        assert flusher.stats.written == 2 and flusher.stats.failures == 0
    finally:
        store.gate.set()
        flusher.close()


def test_a_slot_reused_before_submit_is_skipped_and_holds_nothing(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, run_id="r", topology="t", rank=0, verify_integrity=True)
    flusher = DiskFlusher(lambda: store, trust=lambda step: TrustStatus.UNVERIFIED)
    s = Slot("s")
    try:
        _fill(s, 5)
        s.invalidate()
        flusher.submit([s])
        assert flusher.wait_idle(10)
        _fill(s, 6)  # would wait forever on a leaked guard
        assert store.steps(0) == []
    finally:
        flusher.close()


def test_submit_after_close_queues_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ShardStore(tmp_path, run_id="r", topology="t", rank=0, verify_integrity=True)
    flusher = DiskFlusher(lambda: store, trust=lambda step: TrustStatus.UNVERIFIED)
    flusher.close()
    s = Slot("s")
    _fill(s, 2)
    flusher.submit([s])
    assert "closed" in caplog.text
    _fill(s, 3)  # no guard was left behind

"""GEMINI capture on one process: slots, rotation, tearing, errors, memory."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lm_resiliency import CaptureError, ConfigError, InMemoryCkptConfig, StateEncodingError
from lm_resiliency.capture.slot import Slot, SlotState
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.state import Deferred


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "position": {"epoch": 0, "batch": step},
    }


def _train_step(model: nn.Module) -> None:
    model(torch.randn(5, 8)).square().mean().backward()


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return type(tree)((k, _clone(v)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone(v) for v in tree)
    return tree


def _assert_same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_contract_training_loop_round_trips_every_capture_bit_exactly() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = {}
    with InMemoryCheckpointManager(InMemoryCkptConfig(interval=2)) as manager:
        for step in range(1, 9):
            _train_step(model)
            manager.maybe_wait()
            opt.step()
            opt.zero_grad()
            if step % manager.config.interval == 0:
                state = _state(model, opt, step)
                expected[step] = _clone(state)
                manager.save(state, step)
            if step == 1:
                # structure changes: AdamW state appears after the first optimizer step
                assert opt.state_dict()["state"]
        latest = manager.find_latest()
        assert latest == 8
        assert manager.slots()["own_current"].step == 8
        assert manager.slots()["own_previous"].step == 6
        _assert_same(manager.load(8), expected[8])
        _assert_same(manager.load(6), expected[6])  # own_previous
        # load() leaves the slots attachable until the state is applied; commit_restore()
        # then hands their arenas over instead of copying them, and (the slots live in the
        # memory folder) copies each step back into a fresh own slot in the background:
        # the last one recovered becomes own_current, so the next capture keeps it
        manager.commit_restore()
        manager.maybe_wait()  # the copies are done; each is complete once its CRCs matched
        manager.wait_persisted()
        assert {r: s.step for r, s in manager.slots().items()} == {
            "own_current": 6,
            "own_previous": 8,
        }
        _assert_same(manager.load(6), expected[6])
        manager.save(_state(model, opt, 10), 10)
        manager.maybe_wait()
        assert {r: s.step for r, s in manager.slots().items()} == {
            "own_current": 10,
            "own_previous": 6,
        }
        assert manager.find_latest() == 10


def test_structure_change_relayouts_and_each_slot_keeps_its_own_layout() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with InMemoryCheckpointManager() as manager:
        before = _clone(_state(model, opt, 0))
        manager.save(_state(model, opt, 0), 0)  # optimizer state still empty
        manager.maybe_wait()
        _train_step(model)
        opt.step()
        after = _clone(_state(model, opt, 1))
        manager.save(_state(model, opt, 1), 1)
        manager.maybe_wait()
        assert manager.stats.relayouts == 1
        assert manager.find_latest() == 1
        _assert_same(manager.load(0), before)
        _assert_same(manager.load(1), after)


def test_capture_is_not_torn_by_changes_after_maybe_wait() -> None:
    model = _model()
    with InMemoryCheckpointManager() as manager:
        original = _clone(model.state_dict())
        manager.save({"model": model.state_dict()}, 5)
        manager.maybe_wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        loaded = manager.load(5)["model"]
        _assert_same(loaded, original)
        assert not torch.equal(loaded["0.weight"], model.state_dict()["0.weight"])


def test_two_quick_saves_keep_both_steps_distinct() -> None:
    t = torch.arange(1 << 20, dtype=torch.float32)
    with InMemoryCheckpointManager() as manager:
        manager.save({"t": t}, 1)
        manager.maybe_wait()
        t.mul_(2)  # allowed after maybe_wait
        manager.save({"t": t}, 2)  # waits for cycle 1, then launches cycle 2
        manager.maybe_wait()
        assert torch.equal(manager.load(1)["t"], torch.arange(1 << 20, dtype=torch.float32))
        assert torch.equal(manager.load(2)["t"], torch.arange(1 << 20, dtype=torch.float32) * 2)


def test_rotation_swaps_arenas_instead_of_copying() -> None:
    with InMemoryCheckpointManager() as manager:
        manager.save({"t": torch.ones(1000)}, 1)
        manager.maybe_wait()
        first = manager.slots()["own_current"]
        manager.save({"t": torch.zeros(1000)}, 2)
        manager.maybe_wait()
        second = manager.slots()["own_current"]
        assert manager.slots()["own_previous"] is first and first.step == 1
        ptr_second = second.arena.data_ptr()
        manager.save({"t": torch.full((1000,), 3.0)}, 3)
        manager.maybe_wait()
        # step 3 reused step 1's buffer; step 2 stayed where it was
        assert manager.slots()["own_current"] is first and first.step == 3
        assert manager.slots()["own_previous"].arena.data_ptr() == ptr_second
        assert {s.state for s in manager.slots().values()} == {SlotState.CAPTURED}


def test_host_memory_is_exactly_two_own_slots_of_the_state_size() -> None:
    model = _model()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with InMemoryCheckpointManager() as manager:
        manager.save({"model": model.state_dict()}, 1)
        manager.maybe_wait()
        assert manager.arena_bytes() == state_bytes  # lazily: only the slot in use
        manager.save({"model": model.state_dict()}, 2)
        manager.maybe_wait()
        assert manager.arena_bytes() == 2 * state_bytes


def test_unsupported_value_fails_at_capture_with_its_key_path() -> None:
    with InMemoryCheckpointManager() as manager:
        with pytest.raises(StateEncodingError) as info:
            manager.save({"extra": {"callback": lambda: 1}}, 1)
        assert "extra/callback" in str(info.value)
        assert "function" in str(info.value)
        assert manager.find_latest() is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"interval": 0}, "interval=0"),
        ({"interval": -3}, "interval=-3"),
        ({"replication_chunk_size": 0}, "replication_chunk_size=0"),
        ({"replication_jump": 0}, "replication_jump=0"),
        ({"replication_jump": -2}, "use -1"),
        ({"disk_flush_interval": -1}, "disk_flush_interval=-1"),
        ({"run_id": ""}, "run_id=''"),
        ({"copy_rate_limit_bytes_per_s": 10}, "copy_rate_limit_bytes_per_s=10"),
    ],
)
def test_bad_config_names_the_field_and_a_fix(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        InMemoryCkptConfig(**kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = InMemoryCkptConfig(interval=5)
    with pytest.raises(AttributeError):
        cfg.interval = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        InMemoryCkptConfig(5)  # type: ignore[misc]


def test_worker_failure_surfaces_on_the_next_call_with_the_step(monkeypatch) -> None:
    real_prepare = Slot.prepare
    failing = threading.Event()

    def prepare(self, layout, *, pin):  # an arena allocation failing, e.g. out of pinned memory
        if failing.is_set():
            raise MemoryError("cannot allocate host arena")
        return real_prepare(self, layout, pin=pin)

    monkeypatch.setattr(Slot, "prepare", prepare)
    with InMemoryCheckpointManager() as manager:
        manager.save({"t": torch.ones(10)}, 1)
        manager.maybe_wait()
        failing.set()
        manager.save({"t": torch.ones(10)}, 2)
        with pytest.raises(CaptureError) as info:
            manager.maybe_wait()
        assert "step 2" in str(info.value)
        assert isinstance(info.value.__cause__, MemoryError)
        assert manager.stats.failures == 1
        # the failed slot is never exposed; step 1 is still recoverable
        assert manager.find_latest() == 1
        failing.clear()
        manager.save({"t": torch.full((10,), 3.0)}, 3)
        manager.maybe_wait()
        assert manager.find_latest() == 3
        assert torch.equal(manager.load(1)["t"], torch.ones(10))


def test_rate_limited_copy_is_still_bit_exact() -> None:
    t = torch.randn(3 << 20)
    cfg = InMemoryCkptConfig(copy_rate_limit_bytes_per_s=2_000_000_000)
    with InMemoryCheckpointManager(cfg) as manager:
        manager.save({"t": t, "nc": t[: 1 << 20].view(1024, 1024).t()}, 1)
        manager.maybe_wait()
        out = manager.load(1)
        assert torch.equal(out["t"], t)
        assert torch.equal(out["nc"], t[: 1 << 20].view(1024, 1024).t())


def test_closed_manager_refuses_calls_and_frees_arenas() -> None:
    manager = InMemoryCheckpointManager()
    manager.save({"t": torch.ones(10)}, 1)
    manager.close()
    manager.close()  # idempotent
    assert manager.arena_bytes() == 0
    with pytest.raises(Exception, match="closed"):
        manager.save({"t": torch.ones(10)}, 2)


def test_loaded_rng_state_can_be_restored_directly() -> None:
    # torch.set_rng_state ignores a view's storage offset: small tensors must own storage.
    with InMemoryCheckpointManager() as manager:
        big = torch.randn(400_000)  # sorts before the uint8 RNG state in the arena
        manager.save({"big": big, "rng": torch.get_rng_state()}, 1)
        manager.maybe_wait()
        expected = torch.rand(8)
        state = manager.load(1)
        torch.set_rng_state(state["rng"])
        assert torch.equal(torch.rand(8), expected)
        assert torch.equal(state["big"], big)


def test_deferred_walk_error_surfaces_unwrapped_on_the_next_call() -> None:
    # After the first capture, Deferred subtrees (enable_resiliency's model and optimizer
    # state) are walked by the worker: a bad value there comes out of the next call as the
    # StateEncodingError it is, with its key path and the step; the older step is kept.
    with InMemoryCheckpointManager() as manager:
        manager.save({"adapter": Deferred({"t": torch.ones(3)}), "n": 1}, 1)
        manager.maybe_wait()
        manager.save({"adapter": Deferred({"t": torch.ones(3), "fn": print}), "n": 2}, 2)
        with pytest.raises(StateEncodingError) as info:
            manager.maybe_wait()
        assert "adapter/fn" in str(info.value)
        assert "step 2" in " ".join(getattr(info.value, "__notes__", []))
        assert manager.find_latest() == 1
        manager.save({"adapter": Deferred({"t": torch.full((3,), 7.0)}), "n": 3}, 3)
        manager.maybe_wait()
        assert manager.find_latest() == 3
        assert torch.equal(manager.load(3)["adapter"]["t"], torch.full((3,), 7.0))
        assert torch.equal(manager.load(1)["adapter"]["t"], torch.ones(3))


def test_slot_views_are_built_once_per_arena_and_layout() -> None:
    with InMemoryCheckpointManager() as manager:
        for step in (1, 2, 3):
            manager.save({"t": torch.full((4,), float(step))}, step)
            manager.maybe_wait()
        slot = manager._engine.slots[0]
        assert slot.views() is slot.views()
        assert torch.equal(manager.load(3)["t"], torch.full((4,), 3.0))


class _WorkerKilled(BaseException):
    """Not an Exception: what escapes a handler (the 3.10 ``add_note`` AttributeError was
    one such failure inside the worker's own ``except`` block)."""


def _kill_worker_on_failure(monkeypatch) -> threading.Event:
    """Step captures fail once armed, and handling that failure raises out of the real
    worker thread (its slot's ``invalidate`` raises), so the thread ends mid-cycle."""
    armed = threading.Event()
    real_prepare, real_invalidate = Slot.prepare, Slot.invalidate

    def prepare(self, layout, *, pin):
        if armed.is_set():
            raise MemoryError("cannot allocate host arena")
        return real_prepare(self, layout, pin=pin)

    def invalidate(self):
        if armed.is_set():
            raise _WorkerKilled("the worker's failure handling failed")
        return real_invalidate(self)

    monkeypatch.setattr(Slot, "prepare", prepare)
    monkeypatch.setattr(Slot, "invalidate", invalidate)
    return armed


@pytest.mark.timeout(60)
def test_a_dead_capture_worker_fails_every_wait_instead_of_hanging(monkeypatch) -> None:
    armed = _kill_worker_on_failure(monkeypatch)
    manager = InMemoryCheckpointManager()
    manager.save({"t": torch.ones(10)}, 1)
    manager.maybe_wait()
    armed.set()
    manager.save({"t": torch.ones(10)}, 2)
    with pytest.raises(CaptureError, match="capture worker stopped") as info:
        manager.maybe_wait()
    assert isinstance(info.value.__cause__, _WorkerKilled)
    for call in (
        lambda: manager.save({"t": torch.ones(10)}, 3),
        manager.maybe_wait,
        manager.wait_persisted,
    ):
        with pytest.raises(CaptureError, match="capture worker stopped"):
            call()
    with pytest.raises(CaptureError, match="capture worker stopped"):
        manager.close(finished=False)


@pytest.mark.timeout(60)
def test_close_after_the_worker_died_fails_with_its_error(monkeypatch) -> None:
    armed = _kill_worker_on_failure(monkeypatch)
    manager = InMemoryCheckpointManager()
    manager.save({"t": torch.ones(10)}, 1)
    manager.maybe_wait()
    armed.set()
    manager.save({"t": torch.ones(10)}, 2)  # nothing waits until close
    with pytest.raises(CaptureError, match="capture worker stopped") as info:
        manager.close()
    assert isinstance(info.value.__cause__, _WorkerKilled)


@pytest.mark.timeout(60)
def test_the_mtgs_shadow_fails_with_the_dead_workers_error(monkeypatch) -> None:
    from lm_resiliency.transactions.shadow import Shadow

    armed = _kill_worker_on_failure(monkeypatch)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = Shadow(list(model.parameters()), opt, module=model)
    shadow.begin()
    shadow.wait()
    armed.set()
    shadow.begin()  # the real shadow's copy, on its real engine's worker, kills the worker
    with pytest.raises(CaptureError, match="capture worker stopped"):
        shadow.wait()
    with pytest.raises(CaptureError, match="capture worker stopped"):
        shadow.restore()
    with pytest.raises(CaptureError, match="capture worker stopped"):
        shadow.close()

"""The shadow restores parameters, optimizer, scheduler and scaler state bit for bit."""

from __future__ import annotations

import pytest
import torch

from lm_resiliency.errors import CaptureError
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.transactions import Shadow

_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _setup() -> tuple[TinyGPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    return model, opt, sched


def _train_step(model: TinyGPT, opt: torch.optim.Optimizer, sched: object, batch: int) -> None:
    x, y = next(iter(synthetic_batches(batch, 2, 8, 32)))
    torch.manual_seed(100 + batch)  # dropout: the RNG is the transaction's job, not the shadow's
    model(x, y).backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad(set_to_none=True)


def _snapshot(
    model: TinyGPT, opt: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    params = [p.detach().clone() for p in model.parameters()]
    state = {
        i: {k: v.clone() for k, v in opt.state[p].items()}
        for i, p in enumerate(model.parameters())
        if p in opt.state
    }
    return params, state


def _assert_equal(model: TinyGPT, opt: torch.optim.Optimizer, snap: tuple) -> None:  # type: ignore[type-arg]
    params, state = snap
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    live = {i: opt.state[p] for i, p in enumerate(model.parameters()) if p in opt.state}
    assert live.keys() == state.keys()
    for i, entries in state.items():
        assert live[i].keys() == entries.keys()
        for k, v in entries.items():
            assert torch.equal(live[i][k], v), (i, k)


def test_rollback_after_an_update_is_bit_identical_for_every_tensor() -> None:
    model, opt, sched = _setup()
    _train_step(model, opt, sched, 1)  # AdamW state exists now
    shadow = Shadow(list(model.parameters()), opt, sched)
    shadow.begin()
    shadow.wait()
    before = _snapshot(model, opt)
    sched_before = sched.state_dict()
    lr_before = [g["lr"] for g in opt.param_groups]
    _train_step(model, opt, sched, 2)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))  # a corrupt partial update
    assert sched.state_dict() != sched_before
    shadow.restore()
    _assert_equal(model, opt, before)
    assert sched.state_dict() == sched_before
    assert [g["lr"] for g in opt.param_groups] == lr_before
    shadow.close()


def test_rollback_of_the_first_step_removes_optimizer_state_it_created() -> None:
    model, opt, sched = _setup()
    shadow = Shadow(list(model.parameters()), opt, sched)
    shadow.begin()
    before = _snapshot(model, opt)
    _train_step(model, opt, sched, 1)
    assert len(opt.state) > 0
    shadow.restore()
    assert len(opt.state) == 0
    _assert_equal(model, opt, before)
    # the next step from the restored state equals a step from a fresh optimizer
    _train_step(model, opt, sched, 1)
    ref_model, ref_opt, ref_sched = _setup()
    _train_step(ref_model, ref_opt, ref_sched, 1)
    _assert_equal(model, opt, _snapshot(ref_model, ref_opt))
    shadow.close()


def test_tied_weights_are_stored_once_and_layout_grows_with_optimizer_state() -> None:
    model, opt, sched = _setup()
    assert model.lm_head.weight is model.wte.weight
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    listed = [*model.parameters(), model.lm_head.weight]  # tied tensor listed twice
    shadow = Shadow(listed, opt, sched)
    shadow.begin()
    assert shadow.nbytes == unique
    _train_step(model, opt, sched, 1)
    shadow.begin()
    # AdamW: exp_avg and exp_avg_sq per parameter plus a float32 step counter each
    n = len(list(model.parameters()))
    assert shadow.nbytes == 3 * unique + 4 * n
    assert shadow.captures == 2
    shadow.close()


def test_restore_before_any_capture_is_an_error() -> None:
    model, opt, sched = _setup()
    with pytest.raises(CaptureError, match=r"before any Shadow\.begin"):
        Shadow(list(model.parameters()), opt, sched).restore()


def test_grad_scaler_state_is_restored() -> None:
    model, opt, sched = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    shadow = Shadow(list(model.parameters()), opt, sched, scaler)
    x, y = next(iter(synthetic_batches(0, 2, 8, 32)))
    scaler.scale(model(x, y)).backward()
    scaler.step(opt)
    scaler.update()
    shadow.begin()
    before = scaler.state_dict()
    opt.zero_grad()
    scaler.scale(model(x, y)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.state_dict() != before
    shadow.restore()
    assert scaler.state_dict() == before
    assert scaler.get_scale() == before["scale"]
    shadow.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_copied_on_a_side_stream_and_restored_bit_identically() -> None:
    torch.manual_seed(0)
    model = TinyGPT(_CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    x, y = (t.cuda() for t in next(iter(synthetic_batches(0, 2, 8, 32))))
    model(x, y).backward()
    opt.step()
    shadow = Shadow(list(model.parameters()), opt, sched)
    shadow.begin()  # device tensors: side stream; AdamW's host step counters: worker thread
    before = [p.detach().clone() for p in model.parameters()]
    state = [(k, v.clone()) for p in model.parameters() for k, v in sorted(opt.state[p].items())]
    model(x, y).backward()
    shadow.wait()
    opt.step()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    shadow.restore()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    after = [(k, v) for p in model.parameters() for k, v in sorted(opt.state[p].items())]
    assert [k for k, _ in after] == [k for k, _ in state]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, state, strict=True))
    shadow.close()


def test_the_shadow_copy_is_not_checksummed() -> None:
    # The shadow never leaves the process: a CRC-32C pass over its arena after every
    # step's copy (1.5x the copy's own cost) protected nothing.
    model, opt, sched = _setup()
    _train_step(model, opt, sched, 1)
    shadow = Shadow(list(model.parameters()), opt, sched, module=model)
    for _ in range(3):
        shadow.begin()
        shadow.wait()
    shadow._engine.wait_idle()
    assert shadow._engine.stats.captures == 3
    assert shadow._engine.stats.crc_s == []
    assert shadow._engine.current.crcs is None
    before = _snapshot(model, opt)
    _train_step(model, opt, sched, 2)
    shadow.restore()
    _assert_equal(model, opt, before)
    shadow.close()

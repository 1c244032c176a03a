"""The framework-independent parts of the DeepSpeed/Megatron adapters (no framework needed).

``bind_deferred_steps``: the boundary of an optimizer that wraps torch ones and
finishes its step later; ``_optim_state``: optimizer state keyed by explicit
master tensors, restored in place or created in a fresh optimizer.
"""

from __future__ import annotations

import pytest
import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.integrations._inner_hooks import bind_deferred_steps
from lm_resiliency.integrations._optim_state import (
    capture_hparams,
    capture_state,
    restore_hparams,
    restore_state,
)


class Events:
    def __init__(self) -> None:
        self.log: list[str] = []

    def before_step(self) -> None:
        self.log.append("before")

    def optimizer_done(self) -> None:
        self.log.append("done")

    def after_step(self) -> None:
        self.log.append("after")


def _setup(groups: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(groups)])
    opt = torch.optim.SGD([{"params": m.parameters()} for m in model], lr=0.1)
    return model, opt


def _framework_step(model: torch.nn.Module, opt: torch.optim.Optimizer, log: list[str]) -> None:
    """What ZeRO does: the inner optimizer once per group, then its own bookkeeping."""
    model(torch.ones(1, 2)).sum().backward()
    groups = opt.param_groups
    for g in list(groups):
        opt.param_groups = [g]
        opt.step()
    opt.param_groups = groups
    log.append("bookkeeping")


def test_after_step_waits_for_the_next_forward_and_counts_every_group_call() -> None:
    model, opt = _setup(groups=2)
    ev = Events()
    unbind = bind_deferred_steps([opt], 2, [model], ev)
    _framework_step(model, opt, ev.log)
    # The optimizer update is done before the bookkeeping (the RNGs and the data position
    # are taken there); the step is not complete before the bookkeeping.
    assert ev.log == ["before", "done", "bookkeeping"]
    _framework_step(model, opt, ev.log)  # its forward completes the previous step
    assert ev.log == ["before", "done", "bookkeeping", "after", "before", "done", "bookkeeping"]
    unbind()  # the last step of a run is delivered when the hooks go
    assert ev.log[-1] == "after"
    _framework_step(model, opt, ev.log)
    assert ev.log.count("after") == 2  # hooks removed


def test_a_step_without_a_forward_in_between_is_still_completed_first() -> None:
    model, opt = _setup(groups=1)
    ev = Events()
    unbind = bind_deferred_steps([opt], 1, [model], ev)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.step()
    assert ev.log == ["before", "done", "after", "before", "done"]
    unbind()


def test_invalid_boundary_arguments_are_config_errors() -> None:
    model, opt = _setup()
    with pytest.raises(ConfigError, match="calls_per_step=0"):
        bind_deferred_steps([opt], 0, [model], Events())
    with pytest.raises(ConfigError, match="no training module"):
        bind_deferred_steps([opt], 1, [], Events())


def _adam(seed: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    masters = [torch.randn(5, requires_grad=True), torch.randn(3, requires_grad=True)]
    opt = torch.optim.AdamW(masters, lr=0.01)
    return masters, opt


def _train(masters: list[torch.Tensor], opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        sum((m * m).sum() for m in masters).backward()  # type: ignore[union-attr]
        opt.step()


def test_state_restored_into_a_fresh_optimizer_continues_bit_identically() -> None:
    masters, opt = _adam(0)
    _train(masters, opt, 3)
    saved_masters = [m.detach().clone() for m in masters]
    saved = [{k: v.clone() for k, v in s.items()} for s in capture_state(opt, masters)]
    hparams = capture_hparams(opt)
    _train(masters, opt, 2)

    fresh, fresh_opt = _adam(1)  # another process: other values, no state yet
    with torch.no_grad():
        for m, v in zip(fresh, saved_masters, strict=True):
            m.copy_(v)
    restore_state(fresh_opt, fresh, saved, what="test")
    restore_hparams(fresh_opt, hparams, what="test")
    _train(fresh, fresh_opt, 2)
    for a, b in zip(masters, fresh, strict=True):
        assert torch.equal(a, b)
    assert sorted(fresh_opt.state[fresh[0]]) == ["exp_avg", "exp_avg_sq", "step"]


def test_state_of_another_layout_is_refused_with_the_difference_named() -> None:
    masters, opt = _adam(0)
    _train(masters, opt, 1)
    state = capture_state(opt, masters)
    with pytest.raises(ConfigError, match="2 master tensors but this rank has 1"):
        restore_state(opt, masters[:1], state, what="test")
    other = [torch.zeros(4, requires_grad=True), masters[1]]
    with pytest.raises(ConfigError, match=r"shape \(5,\) but the master has \(4,\)"):
        restore_state(opt, other, state, what="test")
    with pytest.raises(ConfigError, match="has 2 optimizer param groups but the optimizer has 1"):
        restore_hparams(opt, capture_hparams(opt) * 2, what="test")


def test_hyperparameters_keep_plain_values_and_leave_framework_objects_out() -> None:
    _, opt = _adam(0)
    opt.param_groups[0]["default_config"] = object()  # what Megatron keeps in a group
    opt.param_groups[0]["lr_mult"] = 1.0
    (hparams,) = capture_hparams(opt)
    assert "default_config" not in hparams and "params" not in hparams
    assert hparams["lr"] == 0.01 and hparams["lr_mult"] == 1.0
    assert hparams["betas"] == (0.9, 0.999)

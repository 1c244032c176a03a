"""The front door's capture boundary leaves the per-tensor work to the capture worker.

``model.state_dict()`` and ``optimizer.state_dict()`` run on the worker after the
boundary returned, while the training thread goes on with the next step; what
that step changes before ``optimizer.step()`` (buffers in the forward, the LR a
scheduler writes) must still be captured as it was at the boundary, and a change
of layout since the previous capture (a new tensor, a reallocated storage, a
resized parameter) must be captured as it is at the step.

The worker is held inside ``model.state_dict()`` (a state-dict pre-hook waiting
on an event) until the training thread has made its change, so each test sees
the worst interleaving every time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


class Net(nn.Module):
    """Two linears; a forward adds 1 to every buffer named ``count*`` (in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, buf in self.named_buffers():
            if name.split(".")[-1].startswith("count"):
                buf.add_(1)
        return self.b(self.a(x))


class Gate:
    """Holds the capture worker inside ``model.state_dict()`` until ``release()``."""

    def __init__(self, model: nn.Module) -> None:
        self.armed = False
        self._open = threading.Event()
        self._worker_in = threading.Event()
        model.register_state_dict_pre_hook(self._hook)

    def _hook(self, *args: Any) -> None:
        if self.armed and threading.current_thread() is not threading.main_thread():
            self._worker_in.set()
            assert self._open.wait(60), "the test never released the capture worker"

    def arm(self) -> None:
        self.armed = True
        self._open.clear()
        self._worker_in.clear()

    def release(self) -> None:
        assert self._worker_in.wait(60), "the capture worker never built the model's state"
        self.armed = False
        self._open.set()


@pytest.fixture
def config(tmp_path: Any) -> Iterator[InMemoryCkptConfig]:
    yield InMemoryCkptConfig(
        disk_folder=str(tmp_path / "disk"), disk_flush_interval=0, memory_folder=None
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _captured(resiliency: Any, step: int) -> dict[str, Any]:
    resiliency.manager.maybe_wait()
    state: dict[str, Any] = resiliency.manager.load(step)["adapter"]
    return state


def test_a_buffer_registered_after_the_first_capture_is_copied_at_the_boundary(
    config: InMemoryCkptConfig,
) -> None:
    model = Net()
    model.a.register_buffer("count", torch.zeros(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate = Gate(model)
    with enable_resiliency(model, opt, interval=2, config=config) as resiliency:
        for _ in range(2):
            _step(model, opt)  # the first capture (step 2), encoded at the boundary
        model.b.register_buffer("count_new", torch.full((5,), 7.0))  # a new tensor
        _step(model, opt)
        gate.arm()
        _step(model, opt)  # step 4: captured
        at_step = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(2, 4)).sum().backward()  # the next forward: every count += 1
        gate.release()
        saved = _captured(resiliency, 4)["model"]
        assert set(saved) == set(at_step)
        for name, value in at_step.items():
            assert torch.equal(saved[name], value), name
        assert float(saved["b.count_new"][0]) == 9.0  # 7 + the forwards of steps 3 and 4


def test_the_lr_a_scheduler_writes_after_the_boundary_is_not_captured(
    config: InMemoryCkptConfig,
) -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gate = Gate(model)
    with enable_resiliency(model, opt, interval=2, config=config) as resiliency:
        for _ in range(3):
            _step(model, opt)
            sched.step()
        gate.arm()
        _step(model, opt)  # step 4: captured with the lr it stepped with
        lr_at_step = opt.param_groups[0]["lr"]
        sched.step()  # the scheduler writes the next step's lr before the worker reads
        assert opt.param_groups[0]["lr"] != lr_at_step
        gate.release()
        saved = _captured(resiliency, 4)["optimizers"][0]
        assert saved["param_groups"][0]["lr"] == lr_at_step


@pytest.mark.parametrize("change", ["reallocated", "resized", "new_group"])
def test_a_layout_change_between_captures_is_captured_as_it_is_at_the_step(
    config: InMemoryCkptConfig, change: str
) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = nn.Parameter(torch.randn(6))
    with enable_resiliency(model, opt, interval=2, config=config) as resiliency:
        for _ in range(2):
            _step(model, opt)
        first = resiliency.manager.stats.relayouts
        with torch.no_grad():
            if change == "reallocated":  # same shape and dtype, a new storage
                model.a.weight.data = torch.randn(4, 4)
            elif change == "resized":  # b now has 6 outputs; its momentum starts over
                for p, shape in ((model.b.weight, (6, 4)), (model.b.bias, (6,))):
                    p.data = torch.randn(shape)
                    del opt.state[p]
            else:  # a new group: its momentum buffer is a new tensor of the next capture
                opt.add_param_group({"params": [extra], "lr": 0.2})
        for _ in range(2):
            if change == "new_group":
                extra.grad = torch.ones(6)
            _step(model, opt)  # step 4 is captured
        live_model = {k: v.clone() for k, v in model.state_dict().items()}
        live_opt = opt.state_dict()
        saved = _captured(resiliency, 4)
        assert set(saved["model"]) == set(live_model)
        for name, value in live_model.items():
            assert torch.equal(saved["model"][name], value), name
        saved_opt = saved["optimizers"][0]
        assert [g["params"] for g in saved_opt["param_groups"]] == [
            g["params"] for g in live_opt["param_groups"]
        ]
        assert set(saved_opt["state"]) == set(live_opt["state"])
        for index, entries in live_opt["state"].items():
            buf = entries["momentum_buffer"]
            assert torch.equal(saved_opt["state"][index]["momentum_buffer"], buf), index
        if change != "reallocated":
            assert resiliency.manager.stats.relayouts > first

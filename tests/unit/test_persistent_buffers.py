"""Persistent module buffers for adapters whose state is not ``module.state_dict()``.

DeepSpeed and Megatron capture the optimizer's master partitions, which hold no
module buffers; ``persistent_buffers`` / ``load_persistent_buffers`` carry the
BatchNorm statistics (and any other persistent buffer) next to them.
"""

from __future__ import annotations

import pytest
import torch

from lm_resiliency.capture.buffers import load_persistent_buffers, persistent_buffers
from lm_resiliency.errors import ConfigError


class _WithCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.cache.sum()


def _trained(seed: int) -> _WithCache:
    torch.manual_seed(seed)
    m = _WithCache()
    for _ in range(3):
        m(torch.randn(5, 3))
    return m


def test_the_copies_are_the_state_dicts_persistent_buffers_taken_at_the_call() -> None:
    m = _trained(0)
    saved = persistent_buffers(m)
    assert set(saved) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    expected = {k: v.clone() for k, v in m.state_dict().items() if k in saved}
    m(torch.randn(5, 3))  # the next forward changes the live buffers in place
    for name, value in saved.items():
        assert torch.equal(value, expected[name]), name
    assert not torch.equal(saved["norm.running_mean"], m.norm.running_mean)


def test_a_restore_puts_them_back_in_place_bit_identical() -> None:
    source, target = _trained(0), _trained(1)
    before = target.norm.running_mean
    load_persistent_buffers(target, persistent_buffers(source), what="test")
    assert target.norm.running_mean is before  # same tensor object, new values
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_a_different_model_is_refused_before_anything_is_written() -> None:
    target = _trained(1)
    saved = persistent_buffers(_trained(0))
    saved["norm.running_var"] = torch.ones(4)
    want = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ConfigError, match=r"norm\.running_var.*\(4,\).*\(3,\)"):
        load_persistent_buffers(target, saved, what="test")
    del saved["norm.running_var"]
    with pytest.raises(ConfigError, match=r"missing \['norm\.running_var'\]"):
        load_persistent_buffers(target, saved, what="test")
    for name, value in target.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_a_capture_without_buffers_is_refused_when_the_model_has_some() -> None:
    with pytest.raises(ConfigError, match=r"holds no module buffers.*durable"):
        load_persistent_buffers(_trained(0), None, what="test")
    load_persistent_buffers(torch.nn.Linear(2, 2), None, what="test")  # nothing to restore


def test_several_modules_are_all_checked_before_any_is_written() -> None:
    # Megatron's model chunks: a mismatch in the second leaves the first untouched.
    from lm_resiliency.capture.buffers import match_persistent_buffers, write_buffers

    first, second = _trained(1), _trained(2)
    want = {k: v.clone() for k, v in first.state_dict().items()}
    saved = [persistent_buffers(_trained(0)), persistent_buffers(_trained(0))]
    del saved[1]["norm.running_mean"]
    with pytest.raises(ConfigError, match="missing"):
        write_buffers(
            [
                pair
                for module, values in zip((first, second), saved, strict=True)
                for pair in match_persistent_buffers(module, values, what="test")
            ]
        )
    for name, value in first.state_dict().items():
        assert torch.equal(value, want[name]), name

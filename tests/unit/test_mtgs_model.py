"""The trainer's tiny GPT and its deterministic synthetic token stream."""

from __future__ import annotations

import pytest
import torch

from lm_resiliency.errors import ConfigError
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches


def test_forward_gives_logits_or_the_loss_and_ties_embeddings() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8)
    model = TinyGPT(cfg)
    x, y = next(synthetic_batches(0, 3, 16, 50))
    assert model(x).shape == (3, 16, 50)
    loss = model(x, y)
    assert loss.shape == () and torch.isfinite(loss)
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert not list(model.buffers())  # nothing for DDP to broadcast
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"n_embd": 10, "n_head": 4}, "n_embd=10 is not divisible by n_head=4"),
        ({"n_layer": 0}, "n_layer=0 must be an int >= 1"),
        ({"dropout": 1.0}, "dropout=1.0 must be in [0, 1)"),
    ],
)
def test_config_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_synthetic_batches_are_deterministic_resumable_and_per_rank() -> None:
    a = synthetic_batches(7, 4, 12, 64, rank=0, world_size=2)
    b = synthetic_batches(7, 4, 12, 64, rank=0, world_size=2)
    other = synthetic_batches(7, 4, 12, 64, rank=1, world_size=2)
    first = [next(a) for _ in range(3)]
    assert all(
        torch.equal(x1, x2)
        for (x1, _), (x2, _) in zip(first, [next(b) for _ in range(3)], strict=True)
    )
    assert not torch.equal(next(other)[0], first[0][0])
    x, y = first[0]
    assert x.dtype == torch.int64 and x.shape == (4, 12) and int(x.max()) < 64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    state = a.state_dict()
    assert state == {"position": 3}
    nxt = next(a)
    a.load_state_dict(state)
    assert torch.equal(next(a)[0], nxt[0])
    with pytest.raises(ConfigError, match="vocab >= 2"):
        synthetic_batches(0, 1, 1, 1)

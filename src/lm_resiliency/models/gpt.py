"""A tiny GPT-style causal transformer and a deterministic synthetic token stream.

Small enough to train for a few steps in seconds on a CPU, real enough to
exercise everything a fault-tolerance layer must handle: dropout (RNG state),
tied input/output embeddings (one tensor, two uses), several DDP buckets, an
AdamW state that appears after the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lm_resiliency.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`; raises ``ConfigError`` when inconsistent."""

    vocab_size: int = 256
    """Token ids are ``0 .. vocab_size-1``."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    """Width; must be divisible by ``n_head``."""
    dropout: float = 0.1
    """Dropout after embeddings, attention and MLP (makes the RNG part of the step)."""
    tie_weights: bool = True
    """Share the token embedding with the output projection."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name}={value!r} must be an int >= 1")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        mlp: torch.Tensor = self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return x + mlp


class TinyGPT(nn.Module):
    """Causal language model: ``model(idx)`` gives logits, ``model(idx, targets)`` the loss.

    ``idx`` and ``targets`` are ``(batch, seq)`` int64 tensors with ``seq <= block_size``.
    No buffers (nothing for DDP to broadcast each forward).
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        cfg = self.config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for block in self.blocks:
            assert isinstance(block, _Block)
            nn.init.normal_(block.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def num_parameters(self) -> int:
        """Parameter count with tied tensors counted once."""
        return sum(p.numel() for p in self.parameters())


class SyntheticTokens:
    """Endless deterministic ``(inputs, targets)`` batches from a built-in synthetic text.

    The text is an order-1 Markov chain over ``vocab`` tokens (each token has
    four likely successors), so a model can learn it. Batch ``i`` of ``rank`` is
    a pure function of ``(seed, rank, world_size, i)``: restoring
    :meth:`state_dict` replays the same batches, and different ranks see
    different data. Iterate it; the position counts batches drawn.
    """

    def __init__(
        self, seed: int, batch: int, seq_len: int, vocab: int, *, rank: int = 0, world_size: int = 1
    ) -> None:
        if batch < 1 or seq_len < 1 or vocab < 2:
            raise ConfigError(
                f"synthetic batches need batch >= 1, seq_len >= 1, vocab >= 2; got "
                f"batch={batch}, seq_len={seq_len}, vocab={vocab}"
            )
        self.seed, self.batch, self.seq_len, self.vocab = seed, batch, seq_len, vocab
        self.rank, self.world_size = rank, world_size
        self.position = 0
        self._text = _markov_text(seed, vocab, max(16 * 1024, 4 * (seq_len + 1)))

    def __iter__(self) -> SyntheticTokens:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.position * self.world_size + self.rank
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(
            0, self._text.numel() - self.seq_len - 1, (self.batch, 1), generator=g
        )
        window = self._text[starts + torch.arange(self.seq_len + 1)]
        self.position += 1
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.seq_len

    def state_dict(self) -> dict[str, Any]:
        """``{"position": batches drawn}`` (JSON-ready)."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by :meth:`state_dict`."""
        self.position = int(state["position"])


def synthetic_batches(
    seed: int, batch: int, seq_len: int, vocab: int, *, rank: int = 0, world_size: int = 1
) -> SyntheticTokens:
    """A :class:`SyntheticTokens` stream (the same arguments)."""
    return SyntheticTokens(seed, batch, seq_len, vocab, rank=rank, world_size=world_size)


def _markov_text(seed: int, vocab: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g).tolist()
    choices = torch.randint(0, 4, (length,), generator=g).tolist()
    token = 0
    out = [0] * length
    for i in range(length):
        out[i] = token
        token = successors[token][choices[i]]
    return torch.tensor(out, dtype=torch.int64)

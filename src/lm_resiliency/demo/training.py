"""The demo's training: a tiny GPT under DDP on synthetic text, and everything it captures.

The captured state is the complete recovery state of a step boundary: model
parameters, AdamW state, the torch RNG (dropout draws from it) and the data
position, plus the step. Restoring it and priming DDP's buckets
(:func:`~lm_resiliency.integrations.ddp.prime_ddp_buckets`) makes the resumed run
bit-identical to an uninterrupted one of the same seed and world size.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.integrations.ddp import prime_ddp_buckets
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

__all__ = ["MODEL", "Trainer", "digest"]

#: Small enough for a 4-rank run on 2 CPU cores to take ~0.1 s per step.
MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
BATCH = 8
SEQ_LEN = 32
LR = 3e-3
# Several DDP buckets (the model has ~0.5 MB of gradients), so the bucket layout
# DDP rebuilds after its first step matters for bit-exact resumption.
BUCKET_CAP_MB = 0.1


class Trainer:
    """One rank's model, optimizer and data stream. Construct on every rank (DDP syncs)."""

    def __init__(self, seed: int, *, rank: int, world_size: int) -> None:
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        torch.manual_seed(seed)
        self.ddp = DistributedDataParallel(TinyGPT(MODEL), bucket_cap_mb=BUCKET_CAP_MB)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=LR)
        self.data = self._stream()
        # Dropout masks differ per rank, as in real data-parallel training.
        torch.manual_seed(seed * 7919 + 1 + rank)

    def _stream(self) -> SyntheticTokens:
        return SyntheticTokens(
            self.seed, BATCH, SEQ_LEN, MODEL.vocab_size, rank=self.rank, world_size=self.world_size
        )

    def forward_backward(self) -> float:
        """Forward and backward on the next batch (gradients all-reduced by DDP); the loss."""
        inputs, targets = next(self.data)
        loss = self.ddp(inputs, targets)
        loss.backward()
        return float(loss.item())

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict[str, Any]:
        """The state tree to capture after ``step``'s optimizer update (no copies)."""
        return {
            "model": self.ddp.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "data": self.data.state_dict(),
            "step": step,
        }

    def restore(self, state: dict[str, Any]) -> int:
        """Apply a state from :meth:`state` and prime DDP; returns its step. Every rank calls it."""
        self.ddp.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.data.load_state_dict(state["data"])
        # One discarded pass on the batch training will see next (its own stream,
        # so the data position does not move); prime_ddp_buckets restores the RNG.
        probe = self._stream()
        probe.load_state_dict(state["data"])
        inputs, targets = next(probe)
        prime_ddp_buckets(self.ddp, lambda model: model(inputs, targets))
        # A copy: restored tensors are views into one arena, and torch.set_rng_state
        # reads from the start of the tensor's storage, ignoring the view's offset
        # (torch 2.13: "Invalid mt19937 state", or worse, from a view).
        torch.set_rng_state(state["rng"].clone())
        return int(state["step"])

    def final_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state by name, contiguous CPU copies (for safetensors)."""
        out = {f"param/{n}": p.detach().clone() for n, p in self.ddp.module.named_parameters()}
        names = {id(p): n for n, p in self.ddp.module.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(param)]}/{key}"] = value.detach().clone()
        return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names and raw bytes: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

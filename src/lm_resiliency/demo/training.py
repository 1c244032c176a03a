"""The demo's training: a tiny GPT on synthetic text under DDP or FSDP2, with AdamW.

What a step depends on (and ``enable_resiliency`` therefore captures): the
parameters and AdamW state, the torch RNG dropout draws from, and the data
position (the stream is a ``state`` object). Restoring them, with DDP's
gradient bucket order re-established by the DDP adapter, makes a resumed run
bit-identical to an uninterrupted one of the same seed and world size.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT

__all__ = ["FRAMEWORKS", "MODEL", "Trainer", "digest"]

#: Small enough for a 4-rank run on 2 CPU cores to take ~0.1 s per step.
MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
BATCH = 8
SEQ_LEN = 32
LR = 3e-3
# Several DDP buckets (the model has ~0.5 MB of gradients), so the bucket layout
# DDP rebuilds after its first step matters for bit-exact resumption.
BUCKET_CAP_MB = 0.1
FRAMEWORKS = ("ddp", "fsdp2")


class Trainer:
    """One rank's model, optimizer and data stream. Construct on every rank (collective).

    ``framework``: ``"ddp"`` (every rank holds the whole model) or ``"fsdp2"``
    (``fully_shard`` per block over all ranks: each rank holds its shards).
    """

    def __init__(self, seed: int, *, rank: int, world_size: int, framework: str = "ddp") -> None:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework={framework!r}; use one of {FRAMEWORKS}")
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.framework = framework
        torch.manual_seed(seed)
        net = TinyGPT(MODEL)
        self.model: torch.nn.Module
        if framework == "ddp":
            self.model = DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB)
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            self.model = net
        self.net = net
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.data = SyntheticTokens(
            seed, BATCH, SEQ_LEN, MODEL.vocab_size, rank=rank, world_size=world_size
        )
        # Dropout masks differ per rank, as in real data-parallel training.
        torch.manual_seed(seed * 7919 + 1 + rank)

    @property
    def ddp(self) -> torch.nn.Module:
        """The model the loop calls (kept for older callers)."""
        return self.model

    def forward_backward(self) -> float:
        """Forward and backward on the next batch (gradients synchronised); the loss."""
        inputs, targets = next(self.data)
        loss = self.model(inputs, targets)
        loss.backward()
        return float(loss.item())

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def final_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer state by name (local shards under FSDP2),
        contiguous CPU copies (for safetensors)."""
        out = {f"param/{n}": _local(p) for n, p in self.net.named_parameters()}
        names = {id(p): n for n, p in self.net.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(param)]}/{key}"] = _local(value)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's own shard
    value = to_local() if callable(to_local) else t
    return value.detach().contiguous().clone()


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names and raw bytes: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

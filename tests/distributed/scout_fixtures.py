"""Models and a training loop shared by the SCOUT tests (run inside real Gloo ranks)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.detection import ScoutStatus
from lm_resiliency.models import GPTConfig, TinyGPT


def accepted(status: ScoutStatus) -> ScoutStatus:
    """A check's status with timing taken out: a STRAGGLER (a timing outlier confirmed on a
    rerun) accepts the capture exactly as HEALTHY does (docs/scout.md), and on a loaded 2-core
    host one rank's replay can really be several times slower than its peers'. The SDC
    verdicts these tests are about are bitwise, never timing-dependent."""
    return ScoutStatus.HEALTHY if status is ScoutStatus.STRAGGLER else status


GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


class DropBlock(nn.Module):
    """A block whose own forward draws dropout (the replay must see the same mask everywhere)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class Counting(nn.Module):
    """Buffers that the forward changes: a call counter and an EMA of the input mean."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


class TinyMoE(nn.Module):
    """Top-1 routed experts: each expert sees a different number of tokens every step."""

    def __init__(self, d: int = 16, n_experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(n_experts)
        )
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        choice = self.router(h).argmax(-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (choice == e).nonzero(as_tuple=True)[0]
            if sel.numel():
                y = y.index_add(0, sel, expert(h[sel]))
        out: torch.Tensor = self.out(h + y)
        return out


class Jitter(nn.Module):
    """A layer whose output depends on the clock: never reproducible, on any rank."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (time.perf_counter_ns() % 1000) * 1e-9


def jitter() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), Jitter(16), nn.Linear(16, 3))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def frozen() -> nn.Module:
    m = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.Linear(32, 3))
    for p in [*m[0].parameters(), *m[1].parameters()]:
        p.requires_grad_(False)
    return m


def dropout() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 16), DropBlock(16), nn.Dropout(0.2), DropBlock(16), nn.Linear(16, 3)
    )


def buffers() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), Counting(16), nn.Linear(16, 3))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: TinyGPT(GPT),
    "mlp": mlp,
    "frozen": frozen,
    "dropout": dropout,
    "buffers": buffers,
    "moe": TinyMoE,
    "jitter": jitter,
}


class Trainer:
    """A model on every rank, the same initial weights, rank-specific data and RNG.

    With ``ddp`` the model is wrapped in DistributedDataParallel; without, the
    gradients are averaged by an explicit all-reduce (replicas stay identical).
    """

    def __init__(self, name: str, *, rank: int, world: int, ddp: bool, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.rank, self.world = name, rank, world
        self.model = MODELS[name]()
        self.net: nn.Module = DDP(self.model) if ddp else self.model
        self.ddp = ddp
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(1000 + rank)
        torch.manual_seed(seed * 7919 + 1 + rank)  # dropout differs per rank, as in training

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gen
        if self.name == "gpt":
            ids = torch.randint(0, GPT.vocab_size, (4, GPT.block_size + 1), generator=g)
            return ids[:, :-1], ids[:, 1:]
        width = 8 if self.name == "moe" else 12
        return torch.randn(24, width, generator=g), torch.randn(
            24, 2 if self.name == "moe" else 3, generator=g
        )

    def step(self) -> float:
        x, y = self.batch()
        loss = self.net(x, y) if self.name == "gpt" else nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        if not self.ddp:  # one flat all-reduce of every gradient (zeros for unused ones)
            params = [p for p in self.model.parameters() if p.requires_grad]
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def state(self, step: int) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].clone())


def digest(tree: Any) -> str:
    """SHA-256 over a state tree's tensors and plain values, in key order (bit identity)."""
    h = hashlib.sha256()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")
        else:
            h.update(f"{path}={value!r}".encode())

    walk(tree, "")
    return h.hexdigest()


class Verdicts:
    """Every check's result by step, recorded when it becomes known.

    With the pipelined verdict (the default) a boundary check at step ``s`` is
    resolved at the next pre-step hook (``manager.maybe_wait()``) or the next SCOUT
    call: ``before_capture(s)`` returns True provisionally, the capture is held,
    and ``last_result`` is step ``s``'s verdict only afterwards. Call
    :meth:`collect` after every resolving call; a capture taken at ``s`` was kept
    exactly when ``results[s].capture_allowed``.
    """

    def __init__(self, scout: Any) -> None:
        self.scout = scout
        self.results: dict[int, Any] = {}
        self.held: list[int] = []
        """Steps whose capture was launched (``before_capture`` returned True)."""

    def collect(self) -> Any:
        """Record the newest resolved result; returns it when it is new, else ``None``."""
        r = self.scout.last_result
        if r is None or self.scout.pending == r.step or self.results.get(r.step) is r:
            return None
        self.results[r.step] = r
        return r

    def captured(self) -> list[int]:
        """The launched captures whose verdict kept them (call after the last resolve)."""
        return [s for s in self.held if self.results[s].capture_allowed]

"""Interim front door for the framework workers: manager + adapter + step boundary.

Stands in for ``enable_resiliency`` where the registry cannot reach an adapter
yet (Megatron Core: its optimizer is not a torch optimizer and its model is a
list of chunks, which ``adapter_for`` rejects): it does what the handle does at
enable time (recover collectively, then hang the capture off the adapter's step
boundary) with the public manager API, and the same ``start_step`` /
``last_recovery.source``/``.sources`` / ``stats.per_capture_s()`` attributes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.integrations.base import Adapter


class Handle:
    """start_step, last_recovery, manager; close()."""

    def __init__(self, adapter: Adapter, config: InMemoryCkptConfig) -> None:
        self.adapter = adapter
        self.manager = InMemoryCheckpointManager(config, load_fallback=adapter.durable_fallback())
        self.step = 0
        self.source = "fresh"
        if self.manager.find_latest() is not None:
            tree = self.manager.load()
            adapter.load_state_dict(tree["adapter"])
            torch.set_rng_state(tree["rng"])
            self.step = int(tree["step"])
            self.source = "gemini"
        elif adapter.durable_fallback() is not None:
            restored = self.manager.load()
            if restored is not None:
                self.step = int(restored)
                self.source = "fallback"
        self.start_step = self.step
        # Blocking time per capture as the loop sees it: state_dict + save at the boundary,
        # plus the wait before the next step (benchmarks/frameworks.py reports it).
        self.blocking_s: list[float] = []
        self._waiting = False
        report = self.manager.last_recovery
        sources = tuple(report.sources) if report is not None else ()
        self.last_recovery = SimpleNamespace(source=self.source, sources=sources)
        self._unbind = adapter.bind(self)

    def before_step(self) -> None:
        t0 = time.perf_counter()
        self.manager.maybe_wait()
        if self._waiting:
            self._waiting = False
            self.blocking_s[-1] += time.perf_counter() - t0

    def after_step(self) -> None:
        self.step += 1
        if self.step % self.manager.config.interval == 0:
            t0 = time.perf_counter()
            tree: dict[str, Any] = {
                "adapter": self.adapter.state_dict(),
                "rng": torch.get_rng_state(),
                "step": self.step,
            }
            self.manager.save(tree, self.step)
            self.blocking_s.append(time.perf_counter() - t0)
            self._waiting = True

    @property
    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(per_capture_s=lambda: list(self.blocking_s))

    def close(self) -> None:
        self._unbind()
        self.manager.close()


def enable(adapter: Adapter, config: InMemoryCkptConfig) -> Handle:
    return Handle(adapter, config)

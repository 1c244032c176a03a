"""Running a replay spec on one rank: every class it names, one :class:`ClassReport` each."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_resiliency.detection.blocks import Block
from lm_resiliency.detection.recipes import DynamicCatalog
from lm_resiliency.detection.replay import ReplayOutcome, parameter_digest, replay
from lm_resiliency.detection.signature import CallSignature, Recorder, decode
from lm_resiliency.detection.wire import ClassReport, RunState

log = logging.getLogger(__name__)


def _sig_hash(sig: CallSignature) -> int:
    h = hashlib.blake2b(sig.key().encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass
class Executed:
    """One rank's reports for a spec, and the local error texts (for the logs)."""

    reports: tuple[ClassReport, ClassReport, ClassReport]
    labels: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


class Executor:
    """Replays what a spec asks for on this rank, with SCOUT's own hooks paused."""

    def __init__(
        self,
        blocks: list[Block],
        extra_params: tuple[torch.nn.Parameter, ...],
        dynamic: DynamicCatalog | None,
        recorders: list[Recorder],
    ) -> None:
        self.blocks = blocks
        self.extra_params = extra_params
        self.dynamic = dynamic
        self.recorders = recorders
        self._last_error = ""
        self._sig_cache: dict[tuple[int, int], tuple[dict[str, Any], CallSignature, int]] = {}
        """Per recipe (block or dynamic index, catalog size): the last spec, decoded."""

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        for r in self.recorders:
            r.paused = True
        try:
            yield
        finally:
            for r in self.recorders:
                r.paused = False

    def run(self, doc: dict[str, Any], classes: set[str]) -> Executed:
        """Replay the parts of ``doc`` whose class is in ``classes``; local."""
        seed = int(doc["seed"])
        dense = optimizer = dynamic = ClassReport()
        labels: list[str] = []
        errors: dict[str, str] = {}
        block_index = doc.get("block")
        block = self.blocks[block_index] if isinstance(block_index, int) else None
        with self._paused():
            if "dense" in classes and block is not None:
                dense = self._replay(block.module, doc.get("dense"), seed, block.index, 0)
                labels.append(f"dense[{block.index}]:{block.label}")
                if dense.state is RunState.ERROR:
                    errors["dense"] = self._last_error
            if "optimizer" in classes and block is not None:
                params = [*block.params, *self.extra_params]
                optimizer = ClassReport(RunState.OK, block.index, 0, 0, parameter_digest(params))
                labels.append(f"optimizer[{block.index}]")
            spec = doc.get("dynamic")
            if "dynamic" in classes and spec is not None and self.dynamic is not None:
                module = self.dynamic.modules[int(spec["module"])]
                k, big_k = int(spec["k"]), int(spec["K"])
                dynamic = self._replay(module, spec["sig"], seed ^ 0x5DEECE66D, k, big_k)
                labels.append(f"dynamic[{k + 1}/{big_k}]:module {spec['module']}")
                if dynamic.state is RunState.ERROR:
                    errors["dynamic"] = self._last_error
        return Executed((dense, optimizer, dynamic), labels, errors)

    def _replay(
        self,
        module: torch.nn.Module,
        sig_doc: dict[str, Any] | None,
        seed: int,
        recipe: int,
        extra: int,
    ) -> ClassReport:
        if sig_doc is None:
            return ClassReport(RunState.NO_SIGNATURE, recipe, extra)
        sig, sig_hash = self._decoded((recipe, extra), sig_doc)
        outcome: ReplayOutcome = replay(module, sig, seed=seed)
        if outcome.error is not None:
            self._last_error = outcome.error
            return ClassReport(RunState.ERROR, recipe, extra, sig_hash)
        return ClassReport(RunState.OK, recipe, extra, sig_hash, outcome.digest, outcome.seconds)

    def _decoded(
        self, recipe: tuple[int, int], sig_doc: dict[str, Any]
    ) -> tuple[CallSignature, int]:
        """The signature a spec names and its hash; cached while the spec repeats.

        A layout's spec repeats from check to check (same shapes, same integer
        ranges), so decoding it and hashing its key (a sorted JSON dump) is done
        once per distinct spec; the revalidation is one comparison of the small
        JSON documents.
        """
        cached = self._sig_cache.get(recipe)
        if cached is not None and cached[0] == sig_doc:
            return cached[1], cached[2]
        sig = decode(sig_doc)
        sig_hash = _sig_hash(sig)
        self._sig_cache[recipe] = (sig_doc, sig, sig_hash)
        return sig, sig_hash

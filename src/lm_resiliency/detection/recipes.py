"""The dynamic catalog: K recipes (e.g. MoE expert shapes), checked one per interval.

An MoE layer's experts see a different number of tokens every step, so their
compute shapes form a catalog rather than one fixed shape. The caller gives the
expert modules and either the K input shapes to check or nothing, in which case
the shapes are discovered from the calls the training makes (the most frequent
distinct signatures, at most ``max_recipes``). The catalog is frozen by the
group's source peer at the start of each cycle; a cycle is complete when all K
recipes of that snapshot were checked and accepted, each on one of the modules
(rotating through them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lm_resiliency.detection.assess import Assessment
from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.signature import CallSignature, Recorder, TensorArg
from lm_resiliency.detection.verdict import Outcome
from lm_resiliency.detection.wire import RankReport
from lm_resiliency.errors import ConfigError


class DynamicCatalog:
    """Modules sharing one architecture (experts) and the shapes to replay them with.

    ``shapes``: for each recipe, the shapes of the positional floating-point
    inputs, e.g. ``[[(64, 512)], [(128, 512)]]`` (dtype: the modules' parameter
    dtype, inputs require grad). ``None``: discover them from the training.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        *,
        shapes: Sequence[Sequence[Sequence[int]]] | None = None,
        max_recipes: int = 8,
    ) -> None:
        self.modules = list(modules)
        if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
            raise ConfigError("DynamicCatalog needs a non-empty list of modules (e.g. the experts)")
        if isinstance(max_recipes, bool) or not isinstance(max_recipes, int) or max_recipes < 1:
            raise ConfigError(f"DynamicCatalog max_recipes={max_recipes!r} must be an int >= 1")
        self.max_recipes = max_recipes
        self.shapes: list[tuple[tuple[int, ...], ...]] | None = None
        if shapes is not None:
            self.shapes = [tuple(tuple(int(d) for d in s) for s in recipe) for recipe in shapes]
            if not self.shapes or any(not r for r in self.shapes):
                raise ConfigError(
                    "DynamicCatalog shapes must list at least one recipe, each with at least "
                    "one input shape, e.g. shapes=[[(64, 512)]]"
                )

    def _dtype(self) -> torch.dtype:
        for p in self.modules[0].parameters():
            return p.dtype
        return torch.float32

    def snapshot(self, recorder: Recorder | None) -> list[CallSignature]:
        """The recipes of a new cycle (given shapes, or the most frequent discovered calls)."""
        if self.shapes is not None:
            dtype = self._dtype()
            return [
                CallSignature(tuple(TensorArg(s, dtype, True) for s in recipe), ())
                for recipe in self.shapes
            ]
        if recorder is None:
            return []
        merged: Counter[str] = Counter()
        examples: dict[str, CallSignature] = {}
        for counts, ex in zip(recorder.counts, recorder.examples, strict=True):
            merged.update(counts)
            for key, sig in ex.items():
                examples.setdefault(key, sig)
        ranked = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))
        return [examples[k] for k, _ in ranked[: self.max_recipes]]


class Cycles:
    """This rank's view of the groups' progress through their dynamic catalogs.

    Updated from the reports of the groups judged here (a rank's own group):
    a group advances when its check of the expected recipe ``k`` was clean; a
    group's cycle is done after its K-th. A cycle is complete job-wide when
    every group is done, which the flags all-reduce decides
    (:meth:`complete` is then called on every rank); any SDC or inconclusive
    comparison anywhere resets every group.
    """

    def __init__(self, groups: ComparisonGroups) -> None:
        self.groups = groups
        self.progress = [0] * len(groups.groups)
        """Per group: the index of the next recipe its cycle needs."""
        self.done = [False] * len(groups.groups)

    def advance(self, a: Assessment, reports: Mapping[int, RankReport], corrupt: bool) -> bool:
        """Apply one check; True when every group judged here has its cycle done."""
        if corrupt:
            self.reset()
            return False
        judged = a.groups()
        for gi in judged:
            c = reports[self.groups.groups[gi][0]].of("dynamic")
            clean = a.verdicts[(gi, "dynamic")].outcome is Outcome.CLEAN
            if clean and c.recipe == self.progress[gi]:
                self.progress[gi] += 1
                if self.progress[gi] >= c.extra:
                    self.progress[gi] = 0
                    self.done[gi] = True
        return bool(judged) and all(self.done[gi] for gi in judged)

    def complete(self) -> None:
        """Every group is done (agreed job-wide): all start over."""
        self.done = [False] * len(self.done)

    def snapshot(self) -> tuple[list[int], list[bool]]:
        """The state :meth:`advance` changes (to undo a round that is re-run)."""
        return list(self.progress), list(self.done)

    def restore(self, saved: tuple[list[int], list[bool]]) -> None:
        self.progress, self.done = list(saved[0]), list(saved[1])

    def reset(self) -> None:
        self.progress = [0] * len(self.progress)
        self.done = [False] * len(self.done)

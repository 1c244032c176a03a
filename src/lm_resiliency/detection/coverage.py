"""Recipe coverage: the newest step at which every dense recipe was checked clean since.

A rotation replays one block per check, so a check says nothing about the
blocks it did not replay. The dense catalog is therefore K recipes, one per
distinct *signature*: the block's module type and parameter shapes
(:func:`~lm_resiliency.detection.blocks.static_key`) together with the call
signature the source recorded (its hash travels in every report). Identical
transformer layers are one recipe; the embedding, the head and the norms are
others.

The rule (docs/scout.md, "Certification": K recipes): a capture at step ``s``
is safe once, in every comparison group, every recipe was checked clean at a
boundary at or after ``s``. Under a persistent fault a recipe that checks clean
at ``t >= s`` computed correctly before ``s`` too, so the state at ``s`` was
trained without it. :meth:`Coverage.frontier` is the newest such ``s``; with a
single signature (or when every recipe is replayed at the check) it is the
check's own step: the K = 1 case, verified at once.

Conservative by construction:

* a block whose call signature no report carried yet is its own recipe until
  it is checked once (its grouping is unknown);
* a block disabled job-wide (not reproducible, or failing on every peer) is a
  recipe that can never be checked: the frontier is ``-inf`` and captures stay
  candidates;
* a recovery (any) starts the coverage afresh: clean checks of the abandoned
  timeline say nothing about the state that continues.

Each rank credits the groups it holds reports of (its own: the reports are
all-gathered inside the comparison group); the job's frontier is the minimum
over the groups, agreed by the flags all-reduce
(:class:`~lm_resiliency.detection.wire.Flags`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from lm_resiliency.detection.assess import Assessment
from lm_resiliency.detection.blocks import Block, static_key
from lm_resiliency.detection.groups import ComparisonGroups
from lm_resiliency.detection.verdict import Outcome
from lm_resiliency.detection.wire import RankReport, RunState

RecipeKey = tuple[str, int]


class Coverage:
    """Per comparison group: each block's recipe and each recipe's newest clean check."""

    def __init__(
        self,
        blocks: list[Block],
        groups: ComparisonGroups,
        *,
        classes: set[str],
        disabled: set[int],
    ) -> None:
        self.blocks = blocks
        self.groups = groups
        self.classes = {c for c in classes if c in ("dense", "optimizer")}
        """The enabled dense-side classes; a block is credited when each ran clean on it."""
        self.disabled = disabled
        """Shared with the planner: blocks no longer replayed (never checkable)."""
        self._static = [static_key(b) for b in blocks]
        n = len(groups.groups)
        self._signature: list[dict[int, int]] = [{} for _ in range(n)]
        self._clean: list[dict[RecipeKey, int]] = [{} for _ in range(n)]

    def key(self, group: int, block: int) -> RecipeKey:
        """The recipe of ``block`` in ``group`` (a block not yet seen is its own recipe)."""
        sig = self._signature[group].get(block)
        if sig is None:
            return (f"unseen block {block}", -1)
        return (self._static[block], sig)

    def recipes(self) -> int:
        """How many distinct recipes the blocks form now (in the first group)."""
        return len({self.key(0, b) for b in range(len(self.blocks))}) if self.groups.groups else 0

    def credit(
        self, step: int, a: Assessment, reports: Mapping[int, RankReport], ran: set[str]
    ) -> None:
        """Record the recipes that this check (classes ``ran``) found clean, group by group."""
        if not self.classes or not self.classes <= ran:
            return  # an enabled class did not run: this check certifies no recipe
        for gi in a.groups():
            ranks = self.groups.groups[gi]
            if any(a.verdicts[(gi, c)].outcome is not Outcome.CLEAN for c in self.classes):
                continue
            source = reports[ranks[0]]  # the group's source (what it asked for)
            first = "dense" if "dense" in self.classes else "optimizer"
            block = source.of(first).recipe
            if not 0 <= block < len(self.blocks):
                continue
            dense = source.of("dense")
            if dense.state is RunState.OK:
                self._signature[gi][block] = dense.signature
            elif "dense" not in self.classes:
                self._signature[gi].setdefault(block, 0)
            self._clean[gi][self.key(gi, block)] = step

    def frontier(self, group: int | None = None) -> float:
        """The newest step whose every recipe was checked clean at or after it.

        ``group``: of that comparison group only (what one rank knows); else of all.

        ``inf`` when nothing is to be covered (no blocks, or the dense and optimizer
        classes are disabled); ``-inf`` while some recipe has no clean check (or a
        block is disabled).
        """
        if not self.classes or not self.blocks:
            return math.inf
        if self.disabled:
            return -math.inf
        low = math.inf
        for gi in range(len(self.groups.groups)) if group is None else [group]:
            clean = self._clean[gi]
            for b in range(len(self.blocks)):
                step = clean.get(self.key(gi, b))
                if step is None:
                    return -math.inf
                low = min(low, step)
        return low

    def unchecked(self) -> list[str]:
        """Labels of the blocks whose recipe has no clean check (for logs and reasons)."""
        return self.behind(-math.inf)

    def behind(self, step: float) -> list[str]:
        """Labels of the blocks whose recipe has no clean check at or after ``step``."""
        out = []
        for b, block in enumerate(self.blocks):
            if b in self.disabled:
                out.append(f"{block.label} (disabled: never checked)")
                continue
            for gi in range(len(self.groups.groups)):
                last = self._clean[gi].get(self.key(gi, b))
                if last is None or last < step:
                    out.append(block.label)
                    break
        return out

    def snapshot(self) -> tuple[list[dict[int, int]], list[dict[RecipeKey, int]]]:
        """The state :meth:`credit` changes (to undo a round that is re-run)."""
        return [dict(d) for d in self._signature], [dict(d) for d in self._clean]

    def restore(self, saved: tuple[list[dict[int, int]], list[dict[RecipeKey, int]]]) -> None:
        self._signature, self._clean = [dict(d) for d in saved[0]], [dict(d) for d in saved[1]]

    def reset(self) -> None:
        """Forget every clean check (after a recovery; the signatures stay known)."""
        for clean in self._clean:
            clean.clear()

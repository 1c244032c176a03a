"""The source peer's choice of what its comparison group replays (the replay spec).

Only the group's source (its lowest rank) records signatures and plans; the spec
it broadcasts tells every member exactly what to replay, so members never need
to agree on anything else. A spec is JSON::

    {"seq": n, "seed": s, "block": i | null,
     "dense": <signature> | null,
     "dynamic": {"k": k, "K": K, "module": m, "sig": <signature>} | null}

A regular spec names everything the enabled classes may need; the check runs only
the classes due at its step. Specs are planned at the end of the previous check
and broadcast in the background (see :class:`~lm_resiliency.detection.scout.Scout`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from lm_resiliency.detection.blocks import Block
from lm_resiliency.detection.recipes import DynamicCatalog
from lm_resiliency.detection.saved_catalog import SavedCatalog
from lm_resiliency.detection.signature import CallSignature, Recorder, encode


def replay_seed(base: int, seq: int) -> int:
    """The seed of one check's replays (63 bits, from the config seed and the check number)."""
    h = hashlib.blake2b(f"scout:{base}:{seq}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


class Planner:
    """Rotation state of one group's source: next block, catalog snapshot, next expert."""

    def __init__(
        self,
        blocks: list[Block],
        recorder: Recorder | None,
        dynamic: DynamicCatalog | None,
        dynamic_recorder: Recorder | None,
        *,
        seed: int,
    ) -> None:
        self.blocks = blocks
        self.recorder = recorder
        self.dynamic = dynamic
        self.dynamic_recorder = dynamic_recorder
        self.seed = seed
        self.dense_next = 0
        self.module_next = 0
        self.snapshot: list[CallSignature] = []
        self.disabled: set[int] = set()
        """Blocks that cannot be replayed (failed on every peer, or not reproducible)."""
        self.saved: SavedCatalog | None = None
        """The catalog a previous process saved: shapes for blocks not recorded yet."""

    def _signature(self, index: int) -> CallSignature | None:
        sig = None if self.recorder is None else self.recorder.signature(index)
        if sig is None and self.saved is not None and index < len(self.saved.dense):
            return self.saved.dense[index]
        return sig

    def pick_block(self, *, need_signature: bool) -> tuple[int, CallSignature | None]:
        """The next block in rotation (with a recorded signature when one is needed)."""
        n = len(self.blocks)
        if n == 0:
            return -1, None
        start = self.dense_next % n
        chosen, sig = start, None
        if need_signature:
            for offset in range(n):
                i = (start + offset) % n
                s = self._signature(i)
                if i not in self.disabled and s is not None:
                    chosen, sig = i, s
                    break
        self.dense_next = (chosen + 1) % n
        return chosen, sig

    def plan(self, *, seq: int, classes: set[str], progress: int) -> dict[str, Any]:
        """The spec of regular check ``seq``; ``progress``: next recipe index of the cycle."""
        doc: dict[str, Any] = {"seq": seq, "seed": replay_seed(self.seed, seq)}
        if classes & {"dense", "optimizer"}:
            block, sig = self.pick_block(need_signature="dense" in classes)
            doc["block"] = block
            doc["dense"] = _encode(sig)
        if "dynamic" in classes:
            if progress == 0 or not self.snapshot:
                self.snapshot = self._snapshot()
            doc["dynamic"] = self._dynamic(progress)
        return doc

    def plan_sweep(self, *, seq: int, round_: int, classes: set[str]) -> dict[str, Any]:
        """Round ``round_`` of a full sweep: block ``round_`` and dynamic recipe ``round_``."""
        doc: dict[str, Any] = {"seq": seq, "seed": replay_seed(self.seed, seq)}
        if round_ < len(self.blocks) and classes & {"dense", "optimizer"}:
            doc["block"] = round_
            sig = None if round_ in self.disabled else self._signature(round_)
            doc["dense"] = _encode(sig)
        if "dynamic" in classes:
            if round_ == 0:
                self.snapshot = self._snapshot()
            doc["dynamic"] = self._dynamic(round_) if round_ < len(self.snapshot) else None
        return doc

    def _snapshot(self) -> list[CallSignature]:
        if self.dynamic is None:
            return []
        found = self.dynamic.snapshot(self.dynamic_recorder)
        if not found and self.saved is not None:
            return list(self.saved.dynamic)  # a fresh process: the recipes saved before
        return found

    def _dynamic(self, k: int) -> dict[str, Any] | None:
        if self.dynamic is None or not self.snapshot:
            return None
        k = k % len(self.snapshot)
        module = self.module_next % len(self.dynamic.modules)
        self.module_next += 1
        return {"k": k, "K": len(self.snapshot), "module": module, "sig": _encode(self.snapshot[k])}


def _encode(sig: CallSignature | None) -> dict[str, Any] | None:
    return None if sig is None else encode(sig)

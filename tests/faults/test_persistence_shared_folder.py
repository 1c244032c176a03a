"""Ranks that share one disk folder on a node retire each other's files without false failures.

Issue 20, item 12: with the default ``disk_folder`` every rank of a node writes
into the same namespace, and a rank holding the replica of a peer on the same
node retains that peer's generations as well as the peer does. Both then retire
the same old shard at once; the one that came second found the file already
renamed into the other's spare pool, its ``write`` raised ``FileNotFoundError``
(counted by the flusher as "persisting step N ... failed") and the rest of that
retention pass was skipped. Before the fix this test saw 3 to 11 such failures
in 200 lockstep steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lm_resiliency.capture import Layout
from lm_resiliency.persistence import ShardStore
from lm_resiliency.testing import run_distributed

_STEPS = 300
_TOPO = "e" * 64


def _both_ranks_retain_both_owners(rank: int, world: int, folder: str) -> dict:
    store = ShardStore(folder, run_id="shared", topology=_TOPO, rank=rank, verify_integrity=True)
    layout = Layout.from_tensors([torch.zeros(16384)], ["w"])
    errors = []
    for step in range(1, _STEPS + 1):
        dist.barrier()  # lockstep, as training keeps the ranks of a node
        # Each rank publishes its own shard and the replica it holds (the flusher
        # writes the replica whenever it gets there before the owner), in the same
        # order on both ranks so that both retain the same owner at the same time.
        for owner in range(world):
            arena = torch.full((16384,), float(owner * 10_000 + step)).view(torch.uint8).clone()
            try:
                store.write(
                    owner_rank=owner,
                    step=step,
                    layout=layout,
                    arena=arena,
                    state_document={"step": step},
                )
            except Exception as exc:  # what the flusher counted as a failed flush
                errors.append(f"step {step} owner {owner}: {type(exc).__name__}: {exc}")
    dist.barrier()
    newest = {}
    for owner in range(world):
        shard = store.read(owner_rank=owner, step=_STEPS)
        (w,) = shard.layout.views(shard.arena)
        newest[owner] = bool(torch.equal(w, torch.full((16384,), float(owner * 10_000 + _STEPS))))
    dist.barrier()
    store.close()
    return {"errors": errors, "newest": newest}


def _generations(folder: Path) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for shard in folder.rglob("rank-*.safetensors"):
        found.setdefault(shard.name, []).append(int(shard.parent.name.split("-", 1)[1]))
    return {name: sorted(steps) for name, steps in sorted(found.items())}


def test_two_ranks_sharing_a_disk_folder_retire_the_same_files_without_failures(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    out = run_distributed(_both_ranks_retain_both_owners, 2, args=(str(folder),), timeout_s=300)
    for rank, o in enumerate(out):
        assert o["errors"] == [], f"rank {rank}: failed writes {o['errors'][:3]}"
        assert o["newest"] == {0: True, 1: True}
    # Retention did all its work: only the newest two generations of each owner remain,
    # and no parked spare outlived the stores.
    assert _generations(folder) == {
        "rank-0.safetensors": [_STEPS - 1, _STEPS],
        "rank-1.safetensors": [_STEPS - 1, _STEPS],
    }
    assert [p.name for p in folder.rglob("*.tmp")] == []

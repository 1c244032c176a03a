"""A node replacement driven by an external manager (experimental transfer API).

    torchrun --nproc-per-node 4 examples/node_replacement.py               # torch-distributed
    torchrun --nproc-per-node 4 examples/node_replacement.py --backend nixl  # one-sided NIXL

Four data-parallel ranks hold identical model shards, and each also holds its
replication partner's replica (jump 2: rank r holds rank (r + 2) % 4's). Rank 3's
node is replaced: its process starts over with nothing. The manager (here rank
0's side thread, in production a separate service talking to the job's store)
picks a rank that has what rank 3 needs, either the holder of rank 3's replica
(rank 1) or a rank with an identical shard of its own (rank 0, not a partner of
rank 3), and publishes one request: a ``TransferKey`` plus the backend. Only the
two ranks the request names act on it; the others keep working. CPU and Gloo.
"""

from __future__ import annotations

import argparse
import json
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from lm_resiliency.capture.layout import Layout
from lm_resiliency.distributed import init_process_group
from lm_resiliency.experimental import NixlTransfer, TorchTransfer, TransferKey
from lm_resiliency.models import GPTConfig, TinyGPT

MODEL = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
REQUEST = "example/replacement-request"
STEP = 120


def arena_of(model: torch.nn.Module) -> tuple[Layout, torch.Tensor]:
    """The model's state in one flat arena, as a GEMINI capture lays it out."""
    names, tensors = zip(*model.state_dict().items(), strict=True)
    layout = Layout.from_tensors(list(tensors), list(names))
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    for view, tensor in zip(layout.views(arena), tensors, strict=True):
        view.copy_(tensor)
    return layout, arena


def manager(store: dist.Store, layout: Layout, backend: str) -> None:
    """The external manager: rank 3 was replaced; rank 0 has an identical shard."""
    key = TransferKey("replace-rank-3/attempt-1", 0, 3, STEP, layout.digest, layout.total_bytes)
    store.set(REQUEST, json.dumps({"key": key.to_json(), "backend": backend}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("torch", "nixl"), default="torch")
    backend = parser.parse_args().backend
    init_process_group("gloo")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = TinyGPT(MODEL)  # identical on every data-parallel rank
    layout, arena = arena_of(model)
    if rank == 0:  # the manager talks to the store on its own connection (clone)
        threading.Thread(target=manager, args=(store.clone(), layout, backend)).start()
    # Every rank learns the request (a bounded wait); only its two endpoints act.
    store.wait([REQUEST], timedelta(seconds=60))
    request = json.loads(store.get(REQUEST))
    key = TransferKey(**request["key"])
    # The backend is the manager's explicit choice: NIXL never falls back to torch.
    transfer: TorchTransfer | NixlTransfer
    if request["backend"] == "nixl":
        transfer = NixlTransfer(run_id="example", timeout_s=30)
    else:
        transfer = TorchTransfer(run_id="example", timeout_s=30)
    if rank == key.src:
        if isinstance(transfer, NixlTransfer):
            with transfer.serve(
                key, layout=layout, state_document={"step": STEP}, arena=arena
            ) as s:
                s.wait()  # the replacement's verdict; then the memory is released
        else:
            transfer.send(key, layout=layout, state_document={"step": STEP}, arena=arena)
        print(f"rank {rank}: served {key.describe}")
    elif rank == key.dst:
        fresh = TinyGPT(MODEL)  # the replacement process starts with other weights
        got = (transfer.fetch if isinstance(transfer, NixlTransfer) else transfer.recv)(key)
        state = dict(zip(model.state_dict(), got.layout.views(got.arena), strict=True))
        fresh.load_state_dict(state)
        pairs = zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
        print(f"rank {rank}: restored step {got.state_document['step']}, bit-identical: {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

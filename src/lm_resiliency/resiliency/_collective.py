"""Small collectives of the front door: agree an int, gather per-rank state trees.

Both run on a caller-given group on the device its backend needs (CUDA for
NCCL, CPU otherwise) and move no pickle: an int is an int64 tensor, a state
tree travels as the safe state encoding (JSON document + raw tensor bytes).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency.state import decode_state, dumps_document, encode_state, loads_document

__all__ = ["all_gather_ints", "all_gather_trees"]

_HEADER = 8  # bytes of the meta-length prefix of a packed tree


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(value: int, group: dist.ProcessGroup | None) -> list[int]:
    """Collective on ``group``: every rank's ``value``, in group-rank order."""
    device = _device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def _pack(tree: Any) -> torch.Tensor:
    enc = encode_state(tree)
    tensors = [t.detach().cpu().contiguous() for t in enc.tensors]
    meta = {
        "document": enc.document,
        "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for t in tensors],
    }  # fmt: skip
    meta_bytes = dumps_document(meta).encode("utf-8")
    parts = [
        torch.tensor(list(len(meta_bytes).to_bytes(_HEADER, "little")), dtype=torch.uint8),
        torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8),
        *[t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()],
    ]
    return torch.cat(parts)


def _unpack(buffer: torch.Tensor) -> Any:
    raw = buffer.cpu()
    n = int.from_bytes(bytes(raw[:_HEADER].tolist()), "little")
    meta = json.loads(bytes(raw[_HEADER : _HEADER + n].numpy()).decode("utf-8"))
    offset = _HEADER + n
    tensors = []
    for spec in meta["tensors"]:
        dtype = getattr(torch, spec["dtype"])
        shape = [int(s) for s in spec["shape"]]
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        chunk = raw[offset : offset + nbytes].clone()
        offset += nbytes
        tensors.append(chunk.view(dtype).reshape(shape))
    document = loads_document(dumps_document(meta["document"]))
    return decode_state(document, tensors)


def all_gather_trees(tree: Any, group: dist.ProcessGroup) -> list[Any]:
    """Collective on ``group``: every rank's state tree, in group-rank order.

    Two all-gathers (sizes, then the padded encodings). Raises
    ``StateEncodingError`` for an unsupported value (before any collective) and
    ``StateSchemaError`` when a peer's encoding does not validate.
    """
    device = _device(group)
    packed = _pack(tree)
    sizes = all_gather_ints(packed.numel(), group)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: packed.numel()] = packed.to(device)
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [_unpack(buf[:size]) for buf, size in zip(out, sizes, strict=True)]

"""What peers must share for their replays to be comparable bit for bit."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from lm_resiliency.detection.replay import module_device


def config_fingerprint(model: nn.Module, structure: int) -> int:
    """64-bit fingerprint of the software, device kind, CPU threads and model structure.

    Peers of a comparison group must agree (checked at construction and in every
    report): different thread counts or library versions change reduction orders,
    and replays would differ without any fault.
    """
    device = module_device(model)
    parts = [torch.__version__, device.type, str(structure)]
    if device.type == "cpu":
        parts.append(f"threads={torch.get_num_threads()}")
    elif device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    h = hashlib.blake2b("|".join(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")

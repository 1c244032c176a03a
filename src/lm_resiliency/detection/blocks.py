"""The dense catalog: the model's parameterised blocks, found from its structure alone.

No module name, type name or attribute name is ever looked at (a model without
an embedding or an output head gets recipes like any other). The partition:

* the root is always split into its children that own parameters (its own direct
  parameters, if any, are covered by the optimizer recipe only);
* a module that owns parameters *directly* is a block (its compute cannot be
  split without losing theirs);
* a module whose class has no ``forward`` of its own (a list or dict container) is
  split into its children;
* a callable module holding more than half of the model's parameters with at
  least two parameterised children (a wrapper such as ``model.transformer``) is
  split too; any other module with parameters is one block (a layer).

For a transformer this yields the embeddings, each layer, the final norm and
the output head; for an ``nn.Sequential`` MLP, its linear layers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Block:
    """One parameterised block: the module, its position and its parameters."""

    index: int
    module: nn.Module
    label: str
    """The module's path in the model, for reports only (never used to choose)."""
    params: tuple[torch.nn.Parameter, ...]


def _params(module: nn.Module) -> list[torch.nn.Parameter]:
    return list(module.parameters())


def _unique_count(params: list[torch.nn.Parameter]) -> int:
    seen: dict[int, int] = {}
    for p in params:
        seen[id(p)] = p.numel()
    return sum(seen.values())


def _is_container(module: nn.Module) -> bool:
    # nn.ModuleList / nn.ModuleDict (and user containers) inherit Module.forward,
    # which only raises: such a module is never called itself.
    return type(module).forward is nn.Module.forward


def _has_direct(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def partition(model: nn.Module) -> list[Block]:
    """The blocks of ``model`` in registration order (see the module docstring)."""
    total = max(1, _unique_count(_params(model)))
    labels = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> None:
        if id(module) in seen or not _params(module):
            return
        children = [c for c in module.children() if _params(c)]
        leaf = not children or (_has_direct(module) and not is_root)
        big = _unique_count(_params(module)) * 2 > total and len(children) >= 2
        if leaf:
            seen.add(id(module))
            found.append(module)
        elif is_root or _is_container(module) or big:
            for child in children:
                visit(child, False)
        else:
            seen.add(id(module))
            found.append(module)

    visit(model, True)
    return [
        Block(i, m, labels.get(id(m), "") or "<root>", tuple(_params(m)))
        for i, m in enumerate(found)
    ]


def static_key(block: Block) -> str:
    """The block's module type and parameter shapes, dtypes and ``requires_grad`` as text.

    Identical layers have equal keys; with the call signature it names the block's
    certification recipe (:mod:`~lm_resiliency.detection.coverage`).
    """
    params = ";".join(f"{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for p in block.params)
    return f"{type(block.module).__qualname__}|{params}"


def structure_fingerprint(blocks: list[Block]) -> int:
    """64-bit fingerprint of the blocks' parameter shapes and dtypes (peers must agree)."""
    h = hashlib.blake2b(digest_size=8)
    for b in blocks:
        h.update(f"{b.index}:{type(b.module).__qualname__}".encode())
        for p in b.params:
            h.update(f"{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return int.from_bytes(h.digest(), "little")


def uncovered_params(model: nn.Module, blocks: list[Block]) -> tuple[torch.nn.Parameter, ...]:
    """Parameters in no block (e.g. the root's own): every optimizer check compares them."""
    covered = {id(p) for b in blocks for p in b.params}
    out: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in covered:
            out[id(p)] = p
    return tuple(out.values())

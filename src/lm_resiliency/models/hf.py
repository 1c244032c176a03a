"""A randomly initialised DistilBERT (from ``transformers``' config; nothing downloaded).

Optional: needs the ``hf`` extra (``pip install 'lm-resiliency[hf]'``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from lm_resiliency.errors import ConfigError

INSTALL_HINT = (
    "--model distilbert needs the 'transformers' package, which is not installed; "
    "install the hf extra: pip install 'lm-resiliency[hf]' "
    "(from a checkout: pip install -e '.[hf]')"
)


def transformers_available() -> bool:
    """Whether ``transformers`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("transformers") is not None


class DistilBertLM(nn.Module):
    """DistilBERT masked-LM head over every position: ``model(idx, targets)`` is the loss."""

    def __init__(self, vocab_size: int, **config: Any) -> None:
        super().__init__()
        if not transformers_available():
            raise ConfigError(INSTALL_HINT)
        # transformers is optional (the hf extra) and heavy: imported only when the model is built.
        from transformers import DistilBertConfig, DistilBertForMaskedLM  # noqa: PLC0415

        self.model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=vocab_size, **config))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=idx, labels=targets).loss
        return loss

"""The stable import path of the Hugging Face ``Trainer`` callback.

``from lm_resiliency.hf import ResiliencyCallback`` stays valid whatever the internal
packages are called; the callback itself lives in :mod:`lm_resiliency.frontdoor.hf`.
Needs the ``hf`` extra (``transformers``).
"""

from __future__ import annotations

from lm_resiliency.frontdoor.hf import ResiliencyCallback

__all__ = ["ResiliencyCallback"]

"""Compatibility namespace for the MTGS commands and imports as documented.

``from mtgs import mtgs_comm_hook, MTGSState`` and ``python -m mtgs.trainer ...``
work as the MTGS description shows; the implementation lives in
:mod:`lm_resiliency.transactions` (and :mod:`lm_resiliency.cli.train`).
"""

from __future__ import annotations

from lm_resiliency.transactions import MTGS, MTGSConfig, MTGSState, StepResult, mtgs_comm_hook

__all__ = ["MTGS", "MTGSConfig", "MTGSState", "StepResult", "mtgs_comm_hook"]

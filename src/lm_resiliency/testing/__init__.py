"""Test utilities for lm-resiliency and for users testing their own integrations.

``run_distributed`` runs a function on N real processes in a Gloo group on
loopback; ``kill_point`` lets a scheduled rank SIGKILL itself at a named point.
"""

from __future__ import annotations

from lm_resiliency._killpoints import kill_point
from lm_resiliency.testing.launcher import run_distributed

__all__ = ["kill_point", "run_distributed"]

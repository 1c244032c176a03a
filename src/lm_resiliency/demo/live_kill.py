"""The live demo's training script with a kill point armed in chosen replicas only.

    LIVE_KILL_REPLICAS=1 LM_RESILIENCY_TEST_KILL=live.forward@12 LMR_LIVE_EVENTS=DIR \\
    lm-resiliency launch --replica-groups 4 --nproc-per-group 1 -- \\
        -m lm_resiliency.demo.live_kill --steps 20 --global-batch 16

The launcher gives every worker the same environment; this keeps ``LM_RESILIENCY_TEST_KILL``
only in the first incarnation of the replicas named by ``LIVE_KILL_REPLICAS`` (a restarted
replica only registers and waits to be admitted), and has the kill point write the wall time of
the kill to ``LMR_LIVE_EVENTS/kill-<replica>`` (:data:`~lm_resiliency._killpoints.KILL_STAMP_ENV`).
Then it runs :mod:`lm_resiliency.demo.live_worker`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lm_resiliency._killpoints import KILL_ENV, KILL_STAMP_ENV

from .live_worker import main

__all__ = ["KILL_REPLICAS_ENV", "arm", "kill_stamp"]

KILL_REPLICAS_ENV = "LIVE_KILL_REPLICAS"


def kill_stamp(run_dir: str | Path, replica: int) -> Path:
    """The file the kill time (``time.time()``) of ``replica`` is written to."""
    return Path(run_dir) / f"kill-{replica}"


def arm() -> None:
    """Keep the kill point in this process only if it is a chosen replica's first incarnation."""
    chosen = {int(r) for r in os.environ.get(KILL_REPLICAS_ENV, "").split(",") if r}
    replica = os.environ.get("LMR_REPLICA_GROUP")  # unset in a warm spare: never armed
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if replica is None or int(replica) not in chosen or not first:
        os.environ.pop(KILL_ENV, None)
        os.environ.pop(KILL_STAMP_ENV, None)
    elif os.environ.get(KILL_ENV):
        os.environ[KILL_STAMP_ENV] = str(kill_stamp(os.environ["LMR_LIVE_EVENTS"], int(replica)))


if __name__ == "__main__":
    arm()
    sys.exit(main())

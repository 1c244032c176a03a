"""The live demo's training script with the kill point armed in chosen replicas only.

``LIVE_KILL_REPLICAS=1,3`` keeps ``LM_RESILIENCY_TEST_KILL`` in replicas 1 and 3 (the launcher
gives every worker the same environment) and records the kill time in the run folder.
"""

from __future__ import annotations

import os
import sys
import time

from lm_resiliency._killpoints import KILL_ENV
from lm_resiliency.demo.live_worker import main

if __name__ == "__main__":
    chosen = {int(r) for r in os.environ.get("LIVE_KILL_REPLICAS", "").split(",") if r}
    replica = int(os.environ["LMR_REPLICA_GROUP"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if replica not in chosen or not first:
        os.environ.pop(KILL_ENV, None)  # a restarted replica is healed and rejoins
    elif os.environ.get(KILL_ENV):
        import lm_resiliency._killpoints as kp

        real = kp.os.kill

        def stamp(pid: int, sig: int) -> None:
            with open(os.path.join(os.environ["LMR_LIVE_EVENTS"], f"kill-{replica}"), "w") as f:
                f.write(repr(time.time()))
            real(pid, sig)

        kp.os.kill = stamp  # type: ignore[assignment]
    sys.exit(main())

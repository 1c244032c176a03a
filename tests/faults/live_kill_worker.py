"""The live demo's training script with the kill point armed in chosen replicas only.

``LIVE_KILL_REPLICAS=1,3`` keeps ``LM_RESILIENCY_TEST_KILL`` in replicas 1 and 3 (the launcher
gives every worker the same environment) and records the kill time in the run folder
(``lm_resiliency.demo.live_kill``, which the demo runs too).
"""

from __future__ import annotations

import sys

from lm_resiliency.demo.live_kill import arm
from lm_resiliency.demo.live_worker import main

if __name__ == "__main__":
    arm()
    sys.exit(main())

"""A one-rank trainer for the memory-tier kill tests (run as a script by tests/faults).

``capture RUN_ID MIB``: capture a state of ``MIB`` MiB at steps 1, 2, 3, ... (every
value of step ``s``'s state is ``s``), printing ``committed <s>`` after each
capture completed, until killed. ``recover RUN_ID MIB``: a new process recovers the
newest step and prints one JSON line: the step, the sources, and whether every
tensor is exactly the captured one.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager


def state(step: int, mib: int) -> dict:
    n = mib * (1 << 20) // 4
    return {"w": torch.full((n,), float(step)), "tail": torch.full((3,), step), "step": step}


def main() -> int:
    mode, run_id, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    # A torn slot is routine and logged at INFO; the kill tests read its reason from stderr.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = InMemoryCkptConfig(run_id=run_id, interval=1, disk_flush_interval=0, signal_flush=False)
    manager = InMemoryCheckpointManager(cfg)
    if mode == "capture":
        step = 0
        while True:
            step += 1
            manager.save(state(step, mib), step)
            manager.maybe_wait()
            manager.wait_persisted()
            print(f"committed {step}", flush=True)
    step = manager.find_latest()
    got = manager.load(step)
    want = state(step, mib) if step is not None else None
    same = want is not None and all(torch.equal(got[k], want[k]) for k in ("w", "tail"))
    report = manager.last_restore
    print(json.dumps({"step": step, "same": same, "sources": report.sources if report else None}))
    manager.close(finished=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

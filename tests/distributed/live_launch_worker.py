"""A worker for tests/distributed/test_live_launch.py, run by torchrun under the launcher.

``live_launch_worker.py OUTDIR [--touch-store] [--wait] [--exit GROUP:CODE]``: writes
``OUTDIR/g<group>-r<rank>-a<restart>.json`` (its environment, pid and parent pid), then with
``--touch-store`` adds 1 to ``lmr/live/<run>/seen/<group>/<rank>`` on the coordinator's store (and
records the coordinator's ``coord`` record when there is one), with ``--wait`` waits for
``OUTDIR/stop`` (bounded: exits 3 after 180 s), and exits with CODE if its group is GROUP.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

KEYS = (
    "LMR_LIVE_COORDINATOR",
    "LMR_LIVE_RUN",
    "LMR_REPLICA_GROUP",
    "LMR_REPLICA_GROUPS",
    "LMR_LIVE_SPARE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS",
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    p.add_argument("--touch-store", action="store_true")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--exit", default=None)
    a = p.parse_args()
    group, rank = os.environ["LMR_REPLICA_GROUP"], os.environ["RANK"]
    record: dict[str, object] = {
        "env": {k: os.environ.get(k) for k in KEYS},
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    if a.touch_store:
        from torch.distributed import TCPStore

        host, port = os.environ["LMR_LIVE_COORDINATOR"].rsplit(":", 1)
        store = TCPStore(
            host, int(port), is_master=False, timeout=__import__("datetime").timedelta(seconds=60)
        )
        root = f"lmr/live/{os.environ['LMR_LIVE_RUN']}/"
        store.add(f"{root}seen/{group}/{rank}", 1)
        if store.check([root + "coord"]):
            record["coord"] = json.loads(store.get(root + "coord"))
    name = f"g{group}-r{rank}-a{os.environ['TORCHELASTIC_RESTART_COUNT']}.json"
    tmp = a.outdir / (name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(a.outdir / name)
    if a.wait:
        deadline = time.monotonic() + 180
        while not (a.outdir / "stop").exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.1)
    if a.exit is not None:
        g, code = a.exit.split(":")
        if g == group:
            return int(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())

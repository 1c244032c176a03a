"""The examples the docs point to run as documented and do what they say.

``examples/node_replacement.py`` (docs/transfers.md) under the real torchrun agent with
4 Gloo workers: the manager's request makes rank 0 (an identical shard, not rank 3's
replication partner) serve rank 3's replacement, which restores the state bit-identical;
ranks 1 and 2 take no part. Once per backend: torch-distributed, and NIXL where ``nixl``
is installed (CI installs it with ``make extras``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lm_resiliency.testing.torchrun import run_torchrun

pytestmark = pytest.mark.slow

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_HAVE_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "nixl",
            marks=pytest.mark.skipif(
                not _HAVE_NIXL, reason="nixl is not installed (pip install nixl==1.5.1 to run)"
            ),
        ),
    ],
)
def test_node_replacement_example_restores_the_replacement_bit_identical(backend: str) -> None:
    run = run_torchrun(
        [str(_EXAMPLES / "node_replacement.py"), "--backend", backend],
        4,
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=240,
    )
    assert run.returncode == 0, run.describe()
    out = [s.splitlines() for s in run.worker_stdout(0)]
    # NIXL's agent logs to stdout as well: only the example's own lines are compared
    mine = [[ln for ln in lines if ln.startswith("rank ")] for lines in out]
    assert mine == [
        ["rank 0: served 'replace-rank-3/attempt-1' (rank 0 -> rank 3, step 120)"],
        [],
        [],
        ["rank 3: restored step 120, bit-identical: True"],
    ], run.describe()

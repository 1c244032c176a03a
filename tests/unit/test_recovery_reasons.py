"""Why a rank was not served from own memory: the reason per rank in ``last_restore``."""

from __future__ import annotations

from lm_resiliency.checkpointing.restore import not_own_memory
from lm_resiliency.recovery.availability import Report, Source


def test_each_rank_not_served_from_own_memory_gets_its_reason() -> None:
    reports = [
        Report(own_memory=frozenset({10, 20})),
        Report(own_memory=frozenset({10})),
        Report(),
        Report(own_memory=frozenset({20})),
    ]
    sources = [Source.PEER_MEMORY, Source.PEER_MEMORY, Source.OWN_DISK, Source.OWN_MEMORY]
    problems = [
        "rank 0 own memory: checksum_mismatch: arena chunk(s) [0] do not match",
        "rank 3 own disk: not used",
    ]
    assert not_own_memory(20, sources, problems, reports) == [
        "rank 0: its own slot of step 20 failed: checksum_mismatch: arena chunk(s) [0] do not "
        "match",
        "rank 1: own memory has no step 20 (it holds [10])",
        "rank 2: own memory has no step 20 (it holds none)",
    ]

"""Running per-chunk CRC-32C and page population: equal to the one-pass results."""

from __future__ import annotations

import itertools

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.capture import allocate_arena, populate
from lm_resiliency.checksums import ChunkCrc, crc_count, mismatched, pack_crcs, unpack_crcs


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    chunk=st.integers(min_value=1, max_value=700),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=8),
)
def test_running_crc_equals_crc_of_each_chunk_whatever_the_pieces(
    data: bytes, chunk: int, cuts: list[int]
) -> None:
    running = ChunkCrc(chunk, len(data))
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for a, b in itertools.pairwise(bounds):
        running.update(data[a:b])
    expected = [crc32c.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert running.digests() == expected
    assert len(expected) == crc_count(len(data), chunk)


def test_running_crc_refuses_too_many_or_too_few_bytes() -> None:
    running = ChunkCrc(4, 6)
    running.update(b"abc")
    with pytest.raises(ValueError, match="fed 3 of 6"):
        running.digests()
    with pytest.raises(ValueError, match="fed 7 bytes"):
        running.update(b"defg")


def test_checksum_list_round_trips_and_mismatches_are_named() -> None:
    crcs = [0, 1, 0xFFFFFFFF, 12345]
    assert unpack_crcs(pack_crcs(crcs)) == crcs
    with pytest.raises(ValueError, match="not a whole number"):
        unpack_crcs(b"abc")
    assert mismatched([1, 2, 3], [1, 5, 3]) == [1]


def test_populate_keeps_the_bytes_and_arenas_are_usable() -> None:
    t = torch.arange(1 << 20, dtype=torch.int32)
    before = t.clone()
    populate(t[3:70000])  # unaligned start and end
    populate(t)
    assert torch.equal(t, before)
    arena = allocate_arena(5 << 20, pin=False)
    arena.fill_(7)
    assert int(arena.sum()) == 7 * (5 << 20)
    assert allocate_arena(0, pin=False).numel() == 0
    with pytest.raises(ValueError, match="contiguous CPU"):
        populate(t.view(2, -1).t())

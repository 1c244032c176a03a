"""Manager-driven transfers: a named checkpoint bound to endpoints and metadata, per-chunk CRCs."""

from __future__ import annotations

import torch

from lm_resiliency.capture.layout import Layout
from lm_resiliency.checksums import ChunkCrc, pack_crcs
from lm_resiliency.errors import IntegrityError, ReplicationError
from lm_resiliency.knobs import CRC_CHUNK_BYTES
from lm_resiliency.replication import PairingPlan, ReplicationChannel, make_header
from lm_resiliency.replication.transfer import (
    TransferKey,
    recv_checkpoint,
    send_checkpoint,
)
from lm_resiliency.testing import run_distributed


def _arena() -> tuple[Layout, torch.Tensor]:
    t = torch.arange(CRC_CHUNK_BYTES // 4 + 1000, dtype=torch.float32)  # > 1 CRC chunk
    layout = Layout.from_tensors([t], ["t"])
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    layout.views(arena)[0].copy_(t)
    return layout, arena


class _BytesReader:
    """An ArenaReader over bytes in memory (a file's role), optionally with stored CRCs."""

    def __init__(self, arena: torch.Tensor, stored: tuple[int, list[int]] | None) -> None:
        self._arena = arena
        self._stored = stored
        self.reads: list[tuple[int, int]] = []
        self.fail_at: int | None = None

    @property
    def total_bytes(self) -> int:
        return self._arena.numel()

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        self.reads.append((offset, out.numel()))
        if self.fail_at is not None and offset >= self.fail_at:
            raise OSError(f"disk error at byte {offset}")
        out.copy_(self._arena[offset : offset + out.numel()])

    def checksums(self) -> tuple[int, list[int]] | None:
        return self._stored


def _stored_crcs(arena: torch.Tensor, chunk: int, *, flip: bool) -> tuple[int, list[int]]:
    crc = ChunkCrc(chunk, arena.numel())
    crc.update(arena.numpy())
    return chunk, [c ^ 1 if flip and i == 2 else c for i, c in enumerate(crc.digests())]


def _transfer(rank: int, world: int, case: str) -> str:
    plan = PairingPlan.build(2, 1)
    layout, arena = _arena()
    key = TransferKey("gemini/step-7/owner-0", 1, 0, 7, layout.digest, layout.total_bytes)
    with ReplicationChannel(plan, run_id="r", chunk_bytes=1 << 20, timeout_s=20) as ch:
        try:
            if rank == 1:  # holder sends owner 0's replica home
                header = make_header("r", 0, 7, layout, {"k": 1})
                if case == "corrupt":  # a trailer whose checksums do not match the bytes
                    crc = ChunkCrc(CRC_CHUNK_BYTES, arena.numel())
                    crc.update(arena.numpy())
                    bad = {
                        **header,
                        "transfer": key.to_json(),
                        "crc_chunk_bytes": CRC_CHUNK_BYTES,
                        "trailer_bytes": 8,
                    }
                    wrong = pack_crcs([c ^ 1 for c in crc.digests()])
                    ch.send(0, step=7, header=bad, arena=arena, trailer=lambda: wrong)
                elif case == "reader-fails":  # the holder's disk fails mid-stream
                    reader = _BytesReader(arena, None)
                    reader.fail_at = 5 << 20
                    try:
                        send_checkpoint(ch, key, header=header, reader=reader)
                    except OSError as exc:
                        return f"send failed: {exc}"
                elif case.startswith("reader"):
                    stored = None
                    if case != "reader":  # checksums recorded with the bytes (a shard file)
                        stored = _stored_crcs(arena, 3 << 20, flip=case == "reader-rotten")
                    reader = _BytesReader(arena, stored)
                    send_checkpoint(ch, key, header=header, reader=reader)
                    # read chunk by chunk, in order, never the whole arena at once
                    assert [o for o, _ in reader.reads] == list(range(0, arena.numel(), 1 << 20))
                else:
                    send_checkpoint(ch, key, header=header, arena=arena)
                return "sent"
            expect = (
                key
                if case != "wrong-key"
                else TransferKey("gemini/step-7/owner-0", 1, 0, 7, "0" * 32, layout.total_bytes)
            )
            got = recv_checkpoint(ch, expect, owner_rank=0)
            ok = torch.equal(got.arena, arena) and got.state_document == {"k": 1}
            return f"received {ok}"
        except (ReplicationError, IntegrityError) as exc:
            return f"{type(exc).__name__}: {exc}"


def test_named_transfer_arrives_bit_identical() -> None:
    assert run_distributed(_transfer, 2, args=("ok",), timeout_s=90) == ["received True", "sent"]


def test_a_streamed_source_arrives_bit_identical_with_computed_or_stored_checksums() -> None:
    for case in ("reader", "reader-stored"):
        out = run_distributed(_transfer, 2, args=(case,), timeout_s=90)
        assert out == ["received True", "sent"], case


def test_stored_checksums_that_do_not_match_the_streamed_bytes_fail_at_the_owner() -> None:
    out = run_distributed(_transfer, 2, args=("reader-rotten",), timeout_s=90)
    assert out[0].startswith("IntegrityError") and "chunk(s) [2] of 6" in out[0], out[0]


def test_a_source_failing_mid_stream_fails_both_ends_without_a_stall() -> None:
    # The sender drops the edge, so the owner's pending receive fails at once rather
    # than after the channel's 20 s timeout (the run's own bound is 90 s).
    out = run_distributed(_transfer, 2, args=("reader-fails",), timeout_s=90)
    assert out[1] == "send failed: disk error at byte 5242880"
    assert out[0].startswith("ReplicationError"), out[0]


def test_transfer_with_a_wrong_key_is_refused_before_any_bytes() -> None:
    out = run_distributed(_transfer, 2, args=("wrong-key",), timeout_s=90)
    assert out[0].startswith("ReplicationError") and "transfer key mismatch" in out[0]
    assert out[1].startswith("ReplicationError")  # the sender learns it was refused


def test_a_chunk_failing_its_checksum_is_named_and_discarded() -> None:
    out = run_distributed(_transfer, 2, args=("corrupt",), timeout_s=90)
    assert out[0].startswith("IntegrityError")
    assert "chunk(s) [0, 1] of 2" in out[0]

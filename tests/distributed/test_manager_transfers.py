"""Manager-driven transfers (TorchTransfer) between any two ranks: keys, CRCs, bounded waits."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from lm_resiliency.capture.layout import Layout
from lm_resiliency.checksums import arena_crcs
from lm_resiliency.errors import IntegrityError, ReplicationError
from lm_resiliency.experimental import TorchTransfer, TransferKey
from lm_resiliency.knobs import CRC_CHUNK_BYTES
from lm_resiliency.replication import PairingPlan
from lm_resiliency.testing import run_distributed

_MiB = 1 << 20


def _state(owner: int, nbytes: int) -> tuple[Layout, torch.Tensor]:
    """Rank ``owner``'s state: a distinct tensor per owner, laid out in one arena."""
    g = torch.Generator().manual_seed(1000 + owner)
    t = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, generator=g)
    layout = Layout.from_tensors([t], ["w"])
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    layout.views(arena)[0].copy_(t)
    return layout, arena


def _outcome(fn: object) -> str:
    try:
        got = fn()  # type: ignore[operator]
    except (ReplicationError, IntegrityError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "sent" if got is None else got


def _replacements(rank: int, world: int) -> dict[str, str]:
    plan = PairingPlan.build(world, 2)  # partners 0<->2 and 1<->3
    t = TorchTransfer(run_id="run", chunk_bytes=_MiB, timeout_s=20)
    out: dict[str, str] = {}
    # Round 1, two transfers at once between non-partners: 0 serves 1, 3 serves 2.
    src, dst = {0: (0, 1), 1: (0, 1), 2: (3, 2), 3: (3, 2)}[rank]
    assert plan.send_to(src) != dst and plan.recv_from(src) != dst
    layout, arena = _state(dst, 3 * _MiB + 100)
    key = TransferKey(f"replace-{dst}", src, dst, 40, layout.digest, layout.total_bytes)
    if rank == src:
        out["round1"] = _outcome(
            lambda: t.send(key, layout=layout, state_document={"step": 40}, arena=arena)
        )
    else:
        got = t.recv(key)
        same = torch.equal(got.arena, arena) and got.state_document == {"step": 40}
        out["round1"] = f"received {same} owner {got.owner_rank} step {got.step}"
    # Round 2: 2 serves 0 but the manager gave 0 another layout (a wrong key); 1 serves 3
    # from a slot whose chunk 1 flipped a bit after its checksums were recorded.
    if rank in (0, 2):
        layout, arena = _state(0, 2 * _MiB)
        key = TransferKey("replace-0", 2, 0, 50, layout.digest, layout.total_bytes)
        if rank == 2:
            out["round2"] = _outcome(
                lambda: t.send(key, layout=layout, state_document={}, arena=arena)
            )
        else:
            wrong = TransferKey("replace-0", 2, 0, 50, "0" * 32, layout.total_bytes)
            out["round2"] = _outcome(lambda: t.recv(wrong))
    else:
        layout, arena = _state(3, CRC_CHUNK_BYTES + 4 * _MiB)
        key = TransferKey("replace-3", 1, 3, 50, layout.digest, layout.total_bytes)
        if rank == 1:
            recorded = arena_crcs(arena)
            arena[CRC_CHUNK_BYTES + 12345] ^= 0x10
            out["round2"] = _outcome(
                lambda: t.send(
                    key, layout=layout, state_document={}, arena=arena, slot_crcs=recorded
                )
            )
        else:
            out["round2"] = _outcome(lambda: t.recv(key))
    return out


def test_non_partner_transfers_arrive_bit_identical_and_bad_ones_fail_clearly() -> None:
    out = run_distributed(_replacements, 4, ranks_per_node=2, timeout_s=150)
    assert out[0]["round1"] == "sent" and out[3]["round1"] == "sent"
    assert out[1]["round1"] == "received True owner 1 step 40"
    assert out[2]["round1"] == "received True owner 2 step 40"
    # wrong key: refused from the header, before any byte; the server learns why
    assert (
        out[0]["round2"].startswith("ReplicationError")
        and "transfer key mismatch" in out[0]["round2"]
    )
    assert "'layout_digest': '" + "0" * 32 in out[0]["round2"]
    assert (
        out[2]["round2"].startswith("ReplicationError")
        and "peer rejected the header" in out[2]["round2"]
    )
    # flipped chunk: the receiver names the chunk and discards the state
    assert out[3]["round2"].startswith("IntegrityError"), out[3]["round2"]
    assert "'replace-3' from rank 1: chunk(s) [1] of 2" in out[3]["round2"]
    assert out[1]["round2"] == "sent"  # the server's bytes all arrived; only the checksums disagree


class _StallingReader:
    """A shard file's role: the serving process stops for real (SIGSTOP) at ``stop_at``."""

    def __init__(self, arena: torch.Tensor, stop_at: int) -> None:
        self._arena = arena
        self._stop_at = stop_at

    @property
    def total_bytes(self) -> int:
        return self._arena.numel()

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        if offset == self._stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        out.copy_(self._arena[offset : offset + out.numel()])

    def checksums(self) -> None:
        return None


def _stalled_server(rank: int, world: int) -> str:
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())  # test plumbing: who to wake up
    layout, arena = _state(1, 8 * _MiB)
    key = TransferKey("replace-1", 0, 1, 9, layout.digest, layout.total_bytes)
    t = TorchTransfer(run_id="run", chunk_bytes=_MiB, timeout_s=3, max_in_flight=2)
    if rank == 0:
        reader = _StallingReader(arena, stop_at=5 * _MiB)
        return _outcome(lambda: t.send(key, layout=layout, state_document={}, reader=reader))
    result = _outcome(lambda: t.recv(key))
    # The receiver gave up by itself while the server was stopped: only now wake it.
    os.kill(pids[0], signal.SIGCONT)  # type: ignore[arg-type]
    return result


def test_a_stalled_server_fails_the_receiver_within_its_bound_naming_the_peer() -> None:
    out = run_distributed(_stalled_server, 2, timeout_s=90)
    assert out[1].startswith("ReplicationError: rank 1: receive chunk"), out[1]
    assert "from peer 0 for step 9 failed: timed out" in out[1]
    assert out[0].startswith("ReplicationError: rank 0:"), out[0]  # it learns once it resumes

"""NixlTransfer: one-sided NIXL reads of registered host memory (UCX on loopback).

The real tests run where ``nixl`` is importable (``pip install nixl==1.5.1``; its
UCX backend works on CPU-only hosts; CI installs it with ``make extras``); elsewhere they
are skipped with the reason. The clear error for a missing NIXL is checked everywhere, in
an interpreter where nixl cannot be imported.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.capture.layout import Layout
from lm_resiliency.checksums import arena_crcs
from lm_resiliency.errors import IntegrityError, ReplicationError, TransferUnsupported
from lm_resiliency.experimental import NixlTransfer, TransferKey
from lm_resiliency.knobs import CRC_CHUNK_BYTES
from lm_resiliency.testing import run_distributed

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL, reason="nixl is not installed (pip install nixl==1.5.1 to run)"
)
_MiB = 1 << 20


# Run in a fresh interpreter where ``import nixl`` fails as on a host without it: a None
# entry in sys.modules makes Python's import system raise ModuleNotFoundError for it (and
# for nixl._api), so the real import in NixlTransfer fails whether or not nixl is installed.
_WITHOUT_NIXL = """
import sys
sys.modules["nixl"] = None
import torch.distributed as dist
from lm_resiliency.errors import TransferUnsupported
from lm_resiliency.experimental import NixlTransfer
try:
    NixlTransfer(run_id="r", rank=0, store=dist.HashStore())
except TransferUnsupported as exc:
    print(f"TransferUnsupported: {exc}")
"""


def test_without_nixl_the_error_names_the_install_and_the_explicit_alternative() -> None:
    p = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NIXL],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("TransferUnsupported: NIXL is not available ("), p.stdout
    assert (
        "); install it (pip install nixl==1.5.1) or use TorchTransfer (both endpoints take "
        "part) for this request"
    ) in p.stdout


def _state(owner: int, nbytes: int) -> tuple[Layout, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + owner)
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
    return "ok" if got is None else str(got)


def _nixl_rounds(rank: int, world: int) -> dict[str, str]:
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())  # test plumbing: who to wake up
    nixl = NixlTransfer(run_id="run", chunk_bytes=_MiB, timeout_s=20)
    out: dict[str, str] = {}
    # 0. a backend plugin this host lacks is refused when the agent is made, naming both ways on
    out["plugin"] = _outcome(lambda: NixlTransfer(run_id="run", backend="NO_SUCH_PLUGIN"))
    layout, arena = _state(1, CRC_CHUNK_BYTES + 3 * _MiB)

    def key(name: str, digest: str = layout.digest) -> TransferKey:
        return TransferKey(name, 0, 1, 30, digest, layout.total_bytes)

    # 1. one-sided: the server takes no part after serve() (its verdict aside)
    if rank == 0:
        served = nixl.serve(key("read"), layout=layout, state_document={"s": 30}, arena=arena)
        out["read"] = _outcome(served.wait)
        served.close()
    else:
        got = nixl.fetch(key("read"))
        same = torch.equal(got.arena, arena) and got.state_document == {"s": 30}
        out["read"] = f"read {same} owner {got.owner_rank}"
    dist.barrier()
    # 2. a wrong key is refused before any read; 3. a flipped chunk is named
    if rank == 0:
        with nixl.serve(key("wrong"), layout=layout, state_document={}, arena=arena) as served:
            out["wrong"] = _outcome(served.wait)
        recorded = arena_crcs(arena)
        arena[CRC_CHUNK_BYTES + 777] ^= 0x01  # after the slot's checksums were recorded
        flipped = nixl.serve(
            key("flipped"), layout=layout, state_document={}, arena=arena, slot_crcs=recorded
        )
        with flipped as served:
            out["flipped"] = _outcome(served.wait)
        # 4. what NIXL cannot serve fails at once, naming the explicit alternative
        try:
            meta = torch.empty(arena.numel(), dtype=torch.uint8, device="meta")
            nixl.serve(key("meta"), layout=layout, state_document={}, arena=meta)
        except TransferUnsupported as exc:
            out["unsupported"] = str(exc)
    else:
        out["wrong"] = _outcome(lambda: nixl.fetch(key("wrong", "0" * 32)))
        out["flipped"] = _outcome(lambda: nixl.fetch(key("flipped")))
    dist.barrier()
    # 5. a server that stalls (SIGSTOP) right after serving: UCX's connection setup needs
    # its progress thread, so the read cannot finish; it fails within its bound
    if rank == 0:
        nixl.serve(key("stalled"), layout=layout, state_document={}, arena=arena)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 wakes it once its fetch gave up
    else:
        impatient = NixlTransfer(run_id="run", chunk_bytes=_MiB, timeout_s=3)
        out["stalled"] = _outcome(lambda: impatient.fetch(key("stalled")))
        os.kill(pids[0], signal.SIGCONT)  # type: ignore[arg-type]
    return out


@needs_nixl
def test_nixl_reads_one_sided_and_refuses_wrong_keys_flipped_chunks_stalls_and_plugins() -> None:
    out = run_distributed(_nixl_rounds, 2, timeout_s=120)
    server, reader = out
    for rank in out:
        assert rank["plugin"].startswith(
            "TransferUnsupported: NIXL backend 'NO_SUCH_PLUGIN' is not available here (plugins: ["
        ), rank["plugin"]
        assert "'UCX'" in rank["plugin"]  # the plugins this host has
        assert rank["plugin"].endswith(
            "choose another backend= or use TorchTransfer (both endpoints take part) for this "
            "request"
        )
    assert reader["read"] == "read True owner 1"
    assert server["read"] == "ok"
    assert (
        reader["wrong"].startswith("ReplicationError")
        and "transfer key mismatch" in reader["wrong"]
    )
    assert "peer 1 failed: ReplicationError" in server["wrong"]
    assert reader["flipped"].startswith("IntegrityError"), reader["flipped"]
    assert "chunk(s) [1] of 2 failed their CRC-32C check" in reader["flipped"]
    assert "peer 1 failed: IntegrityError" in server["flipped"]
    assert "registered host memory only" in server["unsupported"]
    assert "TorchTransfer" in server["unsupported"]
    assert reader["stalled"].startswith("ReplicationError: rank 1: fetch of transfer 'stalled'")
    assert "from peer 0 failed: read chunk 1/19 not done within 3 s" in reader["stalled"]

"""Abort reason codes and the RNG snapshot a retry restores."""

from __future__ import annotations

import random

import numpy as np
import torch

from lm_resiliency.transactions import AbortReason, RngState, describe, health, reason_names
from lm_resiliency.transactions.reasons import VOTE_REASONS_MAX, decode_codes


def test_vote_codes_fit_a_bfloat16_bucket_exactly() -> None:
    vote = [r for r in AbortReason if r.value < VOTE_REASONS_MAX]
    assert len(vote) == 8
    every = sum(r.value for r in vote)
    assert torch.tensor(float(every), dtype=torch.bfloat16).item() == every


def test_names_decode_and_describe() -> None:
    code = AbortReason.FORWARD_EXCEPTION | AbortReason.OUT_OF_MEMORY
    assert reason_names(code) == ("forward_exception", "out_of_memory")
    assert reason_names(1 << 20) == ("unknown_0x100000",)
    flags = torch.tensor([0.0, 2.0000002, 0.0, float(code)])
    assert decode_codes(flags) == {1: 2, 3: int(code)}
    assert describe({3: int(code), 1: 2}) == (
        "rank 1: nonfinite_grad; rank 3: forward_exception+out_of_memory"
    )
    assert describe({}) == "no rank reported a failure"


def test_rng_restore_replays_torch_python_and_numpy_draws() -> None:
    snap = RngState.capture()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    torch.nn.functional.dropout(torch.ones(8), 0.5)  # consume more
    snap.restore()
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2])


def test_every_gloo_failure_text_seen_in_a_backward_pass_is_a_communication_error() -> None:
    # Texts backward() raised on the survivor of a stopped peer (torch 2.13, Gloo). The
    # last one has no source path: classed as a local error it once turned a peer's
    # timeout into a bogus "comm hook carried no vote" usage error.
    seen = [
        "Got the following error when running the callback: RuntimeError: [/__w/pytorch/"
        "pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 3000ms for recv operation to complete",
        "Got the following error when running the callback: RuntimeError: [/__w/pytorch/"
        "pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer",
        "Got the following error when running the callback: RuntimeError: Application "
        "timeout caused pair closure",
    ]
    for text in seen:
        assert health.is_communication_error(RuntimeError(text)), text
    assert health.is_timeout(RuntimeError(seen[2]))
    assert not health.is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be"))

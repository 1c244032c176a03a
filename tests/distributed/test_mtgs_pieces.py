"""MTGS's tracer, sampler, memory-health vote and hook-less mode, on 2 real Gloo ranks.

One launch (module fixture) runs every part on both ranks; each test checks one
part of what it reported:

* a traced run fed by a ``DataLoader`` over a ``ShardedSampler`` (the sampler is
  MTGS's ``data_state``): step 2 aborted in the vote because rank 1's memory
  headroom (its real RSS against a configured limit it crosses while holding a
  400 MiB ballast) is below ``min_memory_headroom``, step 3 rolled back after an
  injected ``optimizer.step()`` exception, step 4 under ``torch.profiler``;
* the sampler's validation errors (a duplicated rank, other dataset lengths, with
  other or with equal shard lengths, another seed, another ``num_replicas``), on
  every rank alike;
* ``vote_in_hook=False``: MTGS registers no comm hook, so the user's own hook can be
  registered and runs; an exception in the middle of the synchronised backward pass
  is retried bit-identically, with and without gradient accumulation (the failed
  rank completes the buckets it had not launched, found from its gradients).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS, MTGSConfig
from lm_resiliency.transactions.memory_health import headroom, process_rss_bytes
from lm_resiliency.transactions.sampler import ShardedSampler
from lm_resiliency.transactions.tracer import PHASES, Tracer, merge_traces

_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
_BALLAST = 400 * 2**20


def _tokens(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, _CFG.vocab_size, (n, _CFG.block_size + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def _traced(rank: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ShardedSampler(_tokens(), seed=3)
    batches = iter(DataLoader(_tokens(), batch_size=4, sampler=sampler))
    faults = FaultInjector("optimizer_exception@0:3", rank=rank)
    faults.arm()
    faults.install(model, opt)
    ballast: list[torch.Tensor] = []
    limit = 2 * (process_rss_bytes() + 150 * 2**20)  # headroom < 0.5 only with the ballast
    config = MTGSConfig(min_memory_headroom=0.5 if rank == 1 else 0.0, memory_limit_bytes=limit)
    tracer = Tracer(Path(folder) / f"trace-rank{rank}.json", rank=rank)
    txn = MTGS(ddp, opt, config=config, data_state=sampler, faults=faults, tracer=tracer)
    seen: list[list[int]] = []

    def closure() -> torch.Tensor:
        ballast.clear()
        if rank == 1 and txn.committed_steps + 1 == 2 and not seen[1:]:
            ballast.append(torch.ones(_BALLAST // 4))  # touched: resident
        x, y = next(batches)
        seen.append(x[:, 0].tolist())
        loss: torch.Tensor = ddp(x, y)
        return loss

    results = [txn.step(closure) for _ in range(3)]
    with torch.profiler.profile() as prof:
        results.append(txn.step(closure))
    tracer.close()
    profiled = {e.key for e in prof.key_averages() if e.key.startswith("mtgs.")}
    return {
        "results": [
            (r.step, r.attempts, [(a.phase, a.reasons) for a in r.aborts]) for r in results
        ],
        "seen": seen,
        "profiled": sorted(profiled),
        "sampler": sampler.state_dict(),
    }


def _sampler_errors(rank: int) -> dict[str, str]:
    cases: dict[str, dict[str, Any]] = {
        "same rank": {"dataset": 10, "rank": 0, "num_replicas": 2},
        "other length": {"dataset": 10 if rank == 0 else 12},
        "other seed": {"dataset": 10, "seed": rank},
        # shards of 5 on both ranks, disjoint and in order: only the dataset length differs
        "other length, same shards": {"dataset": 10 if rank == 0 else 11, "shuffle": False},
        "other world": {"dataset": 12, "num_replicas": 2 if rank == 0 else 3, "rank": rank},
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            ShardedSampler(kwargs.pop("dataset"), **kwargs)
        except ConfigError as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"
    return out


def _hookless(rank: int, *, fault: bool, micro_batches: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ShardedSampler(_tokens(), seed=5)
    batches = iter(DataLoader(_tokens(), batch_size=2, sampler=sampler))
    txn = MTGS(ddp, opt, config=MTGSConfig(vote_in_hook=False), data_state=sampler)
    calls: list[int] = []  # the step of each bucket the user's hook reduced

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        # (no annotations: DDP compares them with the real GradBucket type)
        calls.append(txn.committed_steps + 1)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)  # the user's own hook: MTGS registered none
    # Rank 1 raises once, at step 2, in the middle of its synchronised (last) backward pass.
    where = {"micro": 0, "fired": False}
    params = [p for p in model.parameters() if p.requires_grad]

    def middle_grad(grad: torch.Tensor) -> None:
        synced = where["micro"] == micro_batches - 1
        if fault and rank == 1 and synced and txn.committed_steps + 1 == 2 and not where["fired"]:
            where["fired"] = True
            raise RuntimeError("injected exception in the middle of the synchronised backward")

    params[len(params) // 2].register_hook(middle_grad)

    def closure(i: int = 0) -> torch.Tensor:
        where["micro"] = i
        x, y = next(batches)
        loss: torch.Tensor = ddp(x, y) / micro_batches
        return loss

    aborts = []
    for _ in range(3):
        r = txn.step(closure, micro_batches=micro_batches)
        aborts += [(r.step, a.phase, a.reasons) for a in r.aborts]
    return {
        "aborts": aborts,
        "hook_calls": [calls.count(step) for step in (1, 2, 3)],
        "params": [p.detach().clone() for p in model.parameters()],
        "fallback": txn.collectives["fallback_allreduces"],
    }


def _worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {"traced": _traced(rank, folder), "sampler": _sampler_errors(rank)}
    for mb in (1, 2):
        ref = _hookless(rank, fault=False, micro_batches=mb)
        bad = _hookless(rank, fault=True, micro_batches=mb)
        out[f"hookless{mb}"] = {
            "aborts": bad["aborts"],
            "ref_aborts": ref["aborts"],
            "hook_calls": (ref["hook_calls"], bad["hook_calls"]),
            "fallback": bad["fallback"],
            "identical": all(
                torch.equal(a, b) for a, b in zip(ref["params"], bad["params"], strict=True)
            ),
        }
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    folder = tmp_path_factory.mktemp("mtgs-pieces")
    return run_distributed(_worker, 2, args=(str(folder),), timeout_s=240), folder


def test_the_trace_parses_as_chrome_json_with_one_event_per_phase(
    run: tuple[list[dict[str, Any]], Path],
) -> None:
    out, folder = run
    for rank in range(2):
        doc = json.loads((folder / f"trace-rank{rank}.json").read_text())
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert {e["name"] for e in spans} == set(PHASES)
        by = {p: [(e["args"]["step"], e["args"]["attempt"]) for e in spans if e["name"] == p]
              for p in PHASES}  # fmt: skip
        # 4 steps, 6 attempts: step 2 aborted in the vote, step 3 rolled back after its commit
        assert by["shadow"] == [(1, 0), (2, 1), (3, 0), (4, 0)]
        assert by["sync"] == by["vote"] == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0)]
        assert by["commit"] == [(1, 0), (2, 1), (3, 0), (3, 1), (4, 0)]
        assert by["abort"] == [(2, 0)] and by["rollback"] == [(3, 0)]
        for e in spans:
            assert e["pid"] == rank and e["args"]["rank"] == rank
            assert isinstance(e["args"]["start_ns"], int) and e["args"]["duration_ns"] >= 0
            assert e["ts"] == e["args"]["start_ns"] / 1e3 and e["dur"] >= 0
        # while a torch profiler records, the phases are record_function ranges too
        assert set(out[rank]["traced"]["profiled"]) >= {"mtgs.sync", "mtgs.vote", "mtgs.commit"}
    merged = merge_traces([folder / "trace-rank0.json", folder / "trace-rank1.json"], folder / "m")
    assert {e["pid"] for e in json.loads(merged.read_text())["traceEvents"]} == {0, 1}


def test_low_memory_headroom_votes_abort_with_its_own_reason(
    run: tuple[list[dict[str, Any]], Path],
) -> None:
    out, _ = run
    for rank in range(2):
        results = out[rank]["traced"]["results"]
        assert results[0] == (1, 1, [])
        assert results[1] == (2, 2, [("vote", {1: ("low_memory",)})])
        assert results[2] == (3, 2, [("commit", {0: ("step_exception",)})])
        assert results[3] == (4, 1, [])


def test_the_sampler_feeds_the_same_batch_to_a_retry_and_its_position_is_state(
    run: tuple[list[dict[str, Any]], Path],
) -> None:
    out, _ = run
    seen = [out[r]["traced"]["seen"] for r in range(2)]
    for rank in range(2):
        s = seen[rank]
        assert len(s) == 6 and s[1] == s[2] and s[3] == s[4]  # retries get the same batch
        assert s[0] != s[1] != s[3] != s[5]
        assert out[rank]["traced"]["sampler"]["position"] == 4 * 4  # 4 committed batches of 4
    first = {tuple(x) for x in seen[0]}
    assert not first & {tuple(x) for x in seen[1]}  # the ranks' batches are disjoint


def test_the_sampler_refuses_shards_that_do_not_partition_the_dataset(
    run: tuple[list[dict[str, Any]], Path],
) -> None:
    out, _ = run
    assert out[0]["sampler"] == out[1]["sampler"]  # every rank raises the same error
    errors = out[0]["sampler"]
    assert re.match(
        r"ShardedSampler: index \d+ is in the shards of ranks 0 and 1 \(ranks passed: "
        r"\{0: 0, 1: 0\}\); shards must be disjoint: give each rank its own rank=",
        errors["same rank"],
    ), errors["same rank"]
    assert errors["other length"].startswith(
        "ShardedSampler: shard lengths differ across ranks {0: 5, 1: 6} (dataset lengths "
        "{0: 10, 1: 12})"
    )
    assert "is in the shards of ranks 0 and 1" in errors["other seed"]
    assert errors["other length, same shards"] == (
        "ShardedSampler: dataset lengths differ across ranks {0: 10, 1: 11}; every rank must "
        "see the same dataset (the same len(dataset)), so that the shards partition it"
    )
    assert errors["other world"].startswith(
        "ShardedSampler: num_replicas per rank {0: 2, 1: 3} but the process group has 2 ranks; "
        "use num_replicas=2"
    )


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_hookless_mode_registers_no_hook_and_retries_a_backward_fault_bit_identically(
    run: tuple[list[dict[str, Any]], Path], micro_batches: int
) -> None:
    out, _ = run
    for rank in range(2):
        h = out[rank][f"hookless{micro_batches}"]
        assert h["ref_aborts"] == []
        assert h["aborts"] == [(2, "vote", {1: ("backward_exception",)})]
        assert h["identical"], "the retried run differs from the fault-free one"
        ref_calls, bad_calls = h["hook_calls"]
        buckets = ref_calls[2]  # per step, once DDP rebuilt its buckets after step 1
        assert buckets > 2
        # step 2 ran twice through the user's hook, every bucket each time (on rank 1 the
        # ones it had not launched before the exception were sent by MTGS's completion)
        assert bad_calls == [ref_calls[0], 2 * buckets, buckets]
        if rank == 1:
            assert 0 < h["fallback"] < buckets  # it had launched some buckets itself


def _cuda_low_memory(rank: int, world: int) -> dict[str, Any]:
    """Two ranks on one GPU (Gloo): rank 1 holds a device ballast in step 2's first attempt."""
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = TinyGPT(_CFG).to(device)
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.02)  # both ranks' CUDA contexts exist now
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = synthetic_batches(1, 4, 16, _CFG.vocab_size, rank=rank, world_size=world)
    free, total = torch.cuda.mem_get_info(device)
    # below the threshold only with the ballast (a quarter of the free memory, held by the
    # allocator); the margin of an eighth absorbs this small model's own allocations
    threshold = (free - free // 8) / total
    txn = MTGS(ddp, opt, config=MTGSConfig(min_memory_headroom=threshold if rank == 1 else 0.0))
    ballast: list[torch.Tensor] = []
    calls = {"n": 0}

    def closure() -> torch.Tensor:
        calls["n"] += 1
        if ballast:  # the retry: give the ballast back to the driver, as a user would
            ballast.clear()
            torch.cuda.empty_cache()
        if rank == 1 and calls["n"] == 2:  # step 2, attempt 0
            ballast.append(torch.empty(free // 4, dtype=torch.uint8, device=device))
        x, y = next(data)
        loss: torch.Tensor = ddp(x.to(device), y.to(device))
        return loss

    results = [txn.step(closure) for _ in range(3)]
    room = headroom(device)
    return {
        "results": [
            (r.step, r.attempts, [(a.phase, a.reasons) for a in r.aborts]) for r in results
        ],
        "where": None if room is None else room.where,
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_low_device_headroom_votes_abort_with_its_own_reason() -> None:
    # run by scripts/gpu_check.sh (its -k cuda pass); skipped on CPU machines
    out = run_distributed(_cuda_low_memory, 2, timeout_s=240)
    for rank in range(2):
        assert out[rank]["where"] == "cuda:0"
        assert out[rank]["results"] == [
            (1, 1, []),
            (2, 2, [("vote", {1: ("low_memory",)})]),
            (3, 1, []),
        ]

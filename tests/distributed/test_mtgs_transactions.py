"""MTGS on real Gloo ranks: votes, aborts, retries, rollbacks, all bit-identical to fault-free runs.

Every run trains the tiny GPT (dropout on, tied embeddings, AdamW, LR schedule,
several DDP buckets) for a few steps. Bit-identity is checked against a
fault-free MTGS run with the same seed and the same number of ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.errors import StepAborted
from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, TinyGPT, synthetic_batches
from lm_resiliency.testing import run_distributed
from lm_resiliency.transactions import MTGS, ExhaustedPolicy, MTGSConfig

_STEPS = 5
_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


class _WithBuffer(torch.nn.Module):
    """Adds a buffer DDP broadcasts from rank 0 at every forward (a collective in forward)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss: torch.Tensor = self.inner(x, y)
        return loss


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[np.ndarray]:
    out = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state.get(p, {})):
            out.append(opt.state[p][key].detach().cpu().numpy().copy())
    return out


def _train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: build, train ``spec['steps']`` transactional steps, report everything."""
    torch.manual_seed(0)
    model = TinyGPT(_CFG)
    device = torch.device("cuda", 0) if spec.get("cuda") else torch.device("cpu")
    model.to(device)
    ddp = DDP(  # several buckets: partial backward passes exist
        _WithBuffer(model) if spec.get("buffer") else model,
        bucket_cap_mb=0.02,
        device_ids=[0] if spec.get("cuda") else None,
        gradient_as_bucket_view=bool(spec.get("bucket_view")),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    data = synthetic_batches(1, 4, 16, 64, rank=rank, world_size=world)
    steps = spec.get("steps", _STEPS)

    def closure() -> torch.Tensor:
        x, y = next(data)
        # the math attention kernel: deterministic backward on CUDA too
        with sdpa_kernel(SDPBackend.MATH):
            loss: torch.Tensor = ddp(x.to(device), y.to(device))
        return loss

    if spec.get("baseline"):
        for _ in range(steps):
            closure().backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return {"state": _state(model, opt)}

    faults = None
    if spec.get("faults"):
        faults = FaultInjector(spec["faults"], rank=rank)
        faults.arm()
        faults.install(model, opt)
    at_update: list[list[np.ndarray]] = []
    opt.register_step_pre_hook(lambda *_: at_update.append(_state(model, opt)))
    unhealthy = spec.get("unhealthy")  # (rank, step): a tensor health check fails once there
    failed_checks: list[int] = []

    def health_check(loss: torch.Tensor) -> torch.Tensor:
        bad = (rank, txn.committed_steps + 1) == tuple(unhealthy) and not failed_checks
        if bad:
            failed_checks.append(1)
        return torch.tensor(not bad)

    txn = MTGS(
        ddp,
        opt,
        sched,
        config=MTGSConfig(**spec.get("config", {})),
        data_state=data,
        faults=faults,
        health_check=health_check if unhealthy else None,
    )
    records, before = [], {}
    error = None
    packs: list[int] = []  # where the last bucket + vote was reduced, per step
    aliased: list[bool] = []  # did any gradient share that buffer's memory at the update?

    def _pack_ptr() -> int:
        pack = getattr(txn.hook, "_pack", None)
        return -1 if pack is None else pack.untyped_storage().data_ptr()

    def _grads_alias_pack(*_: Any) -> None:
        ptrs = {
            p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None
        }
        aliased.append(_pack_ptr() in ptrs)

    opt.register_step_pre_hook(_grads_alias_pack)
    for _ in range(steps):
        step = txn.committed_steps + 1
        before[step] = _state(model, opt)
        mark = len(at_update)
        try:
            r = txn.step(closure)
        except StepAborted as exc:
            error = {"message": str(exc), "step": exc.step, "reasons": exc.reasons}
            break
        records.append(
            {
                "step": r.step,
                "committed": r.committed,
                "attempts": r.attempts,
                "aborts": [(a.phase, a.reasons) for a in r.aborts],
                "updates": at_update[mark:],
            }
        )
        packs.append(_pack_ptr())
    return {
        "packs": packs,
        "aliased": aliased,
        "records": records,
        "before": before,
        "error": error,
        "state": _state(model, opt),
        "collectives": txn.collectives,
        "committed_steps": txn.committed_steps,
    }


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(torch.from_numpy(x), torch.from_numpy(y)) for x, y in zip(a, b, strict=True)
    )


def _run(world: int, **spec: Any) -> list[dict[str, Any]]:
    return run_distributed(_train, world, args=(spec,), timeout_s=240, pg_timeout_s=60)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    """A fault-free 2-rank MTGS run: the target every faulty run must reproduce."""
    return _run(2)


def _aborts(result: dict[str, Any]) -> dict[int, list[tuple[str, dict[int, tuple[str, ...]]]]]:
    return {r["step"]: r["aborts"] for r in result["records"] if r["aborts"]}


def test_fault_free_mtgs_equals_plain_ddp_and_adds_no_collective_without_2pc(
    reference: list[dict[str, Any]],
) -> None:
    plain = _run(2, baseline=True)
    lean = _run(2, config={"shadow": False, "two_phase_commit": False})
    for rank in range(2):
        assert _equal(reference[rank]["state"], plain[rank]["state"])
        assert _equal(lean[rank]["state"], plain[rank]["state"])
        assert _aborts(reference[rank]) == {}
        # the vote rode on the gradient buckets: no collective of MTGS's own
        assert lean[rank]["collectives"]["explicit_votes"] == 0
        assert lean[rank]["collectives"]["commit_confirmations"] == 0
        assert lean[rank]["collectives"]["fallback_allreduces"] == 0
        assert lean[rank]["collectives"]["votes_in_buckets"] == _STEPS
        # full protocol: exactly one commit confirmation per step, no explicit vote
        assert reference[rank]["collectives"]["commit_confirmations"] == _STEPS
        assert reference[rank]["collectives"]["explicit_votes"] == 0
    assert reference[0]["collectives"]["bucket_allreduces"] > 2 * _STEPS  # several buckets


@pytest.mark.parametrize("bucket_view", [False, True])
def test_vote_bucket_is_reduced_in_one_buffer_kept_across_steps(bucket_view: bool) -> None:
    # The last bucket is divided straight into a packed buffer with the vote slots
    # (it was torch.cat into a fresh tensor every step: an extra pass and fresh pages).
    plain = _run(2, baseline=True, bucket_view=bucket_view)
    mtgs = _run(2, bucket_view=bucket_view, config={"shadow": False, "two_phase_commit": False})
    for rank in range(2):
        assert _equal(mtgs[rank]["state"], plain[rank]["state"])
        # one buffer from step 2 on (DDP rebuilds its buckets once, after step 1)
        packs = mtgs[rank]["packs"]
        assert -1 not in packs and packs[1:] == [packs[1]] * (_STEPS - 1), packs
        # DDP copied the reduced gradients out: no gradient aliases the reused buffer
        assert mtgs[rank]["aliased"] == [False] * _STEPS


def test_one_shot_nan_gradient_on_rank1_at_step3_is_retried_bit_identically(
    reference: list[dict[str, Any]],
) -> None:
    out = _run(2, faults="nan_grad@1:3")
    for rank in range(2):
        assert _aborts(out[rank]) == {3: [("vote", {1: ("nonfinite_grad",)})]}
        assert [r["attempts"] for r in out[rank]["records"]] == [1, 1, 2, 1, 1]
        assert _equal(out[rank]["state"], reference[rank]["state"])
        # the abort came before any update: one optimizer.step for step 3, from the pre-step state
        step3 = out[rank]["records"][2]
        assert len(step3["updates"]) == 1
        assert _equal(step3["updates"][0], out[rank]["before"][3])


def test_exceptions_before_all_buckets_were_sent_are_completed_and_retried(
    reference: list[dict[str, Any]],
) -> None:
    # data (before the model is called), forward, OOM, and mid-backward (some buckets
    # already sent): the failing rank completes the collectives with zero gradients.
    faults = "data_exception@0:2,forward_exception@1:3,oom@0:4,backward_exception@1:5"
    out = _run(2, faults=faults)
    expected = {
        2: [("vote", {0: ("forward_exception",)})],
        3: [("vote", {1: ("forward_exception",)})],
        4: [("vote", {0: ("forward_exception", "out_of_memory")})],
        5: [("vote", {1: ("backward_exception",)})],
    }
    for rank in range(2):
        assert _aborts(out[rank]) == expected
        assert _equal(out[rank]["state"], reference[rank]["state"])
    assert out[0]["collectives"]["fallback_allreduces"] > 0  # rank 0 completed steps 2 and 4
    assert out[1]["collectives"]["fallback_allreduces"] > 0  # rank 1 completed steps 3 and 5


def test_failed_rank_also_completes_the_forward_buffer_broadcast() -> None:
    # DDP broadcasts module buffers at the start of every forward: a rank that fails
    # before calling the model (data) must still take part; one failing inside it
    # (forward) has already done so.
    ref = _run(2, buffer=True, steps=3)
    out = _run(2, buffer=True, steps=3, faults="data_exception@1:2,forward_exception@0:3")
    for rank in range(2):
        assert _aborts(out[rank]) == {
            2: [("vote", {1: ("forward_exception",)})],
            3: [("vote", {0: ("forward_exception",)})],
        }
        assert _equal(out[rank]["state"], ref[rank]["state"])


def test_optimizer_exception_after_partial_update_rolls_back_every_rank(
    reference: list[dict[str, Any]],
) -> None:
    out = _run(2, faults="optimizer_exception@1:3")
    for rank in range(2):
        assert _aborts(out[rank]) == {3: [("commit", {1: ("step_exception",)})]}
        step3 = out[rank]["records"][2]
        # two optimizer.step calls in step 3; the retry's starts from the restored shadow,
        # bit-identical to the pre-step state, on both ranks (rank 0 had applied its update)
        assert len(step3["updates"]) == 2
        assert _equal(step3["updates"][0], out[rank]["before"][3])
        assert _equal(step3["updates"][1], out[rank]["before"][3])
        assert _equal(out[rank]["state"], reference[rank]["state"])


def test_persistent_fault_raises_step_aborted_naming_rank_and_reason_nothing_applied() -> None:
    for faults, phase_reason in (
        ("nan_grad@1:2*", "rank 1: nonfinite_grad"),
        ("optimizer_exception@0:2*", "rank 0: step_exception"),
    ):
        out = _run(2, faults=faults, steps=3)
        for rank in range(2):
            err = out[rank]["error"]
            assert err is not None, faults
            assert err["step"] == 2
            assert (
                "step 2 aborted on every rank after 3 attempt(s) (max_retries=2)" in err["message"]
            )
            assert phase_reason in err["message"]
            assert err["reasons"] == {int(phase_reason[5]): (phase_reason.split(": ")[1],)}
            assert out[rank]["committed_steps"] == 1
            # nothing partial: parameters and optimizer state are those from before step 2
            assert _equal(out[rank]["state"], out[rank]["before"][2])


def test_skip_policy_drops_the_bad_step_and_continues() -> None:
    out = _run(
        2,
        faults="nan_grad@0:2*",
        steps=3,
        config={"max_retries": 1, "on_exhausted": ExhaustedPolicy.SKIP},
    )
    for rank in range(2):
        recs = out[rank]["records"]
        assert [(r["step"], r["committed"], r["attempts"]) for r in recs] == [
            (1, True, 1),
            (2, False, 2),
            (3, True, 1),
        ]
        assert recs[1]["updates"] == []
        assert _equal(out[rank]["before"][3], out[rank]["before"][2])
    # both ranks continued identically (DDP replicas stay equal)
    assert _equal(out[0]["state"], out[1]["state"])


def test_health_check_tensor_and_forced_abort_are_votes(reference: list[dict[str, Any]]) -> None:
    out = _run(2, unhealthy=(0, 2), config={"force_abort_steps": {4}})
    for rank in range(2):
        assert _aborts(out[rank]) == {
            2: [("vote", {0: ("health_check",)})],
            4: [("vote", {0: ("forced",), 1: ("forced",)})],
        }
        assert _equal(out[rank]["state"], reference[rank]["state"])


def test_hookless_vote_ablation_still_aborts_consistently(reference: list[dict[str, Any]]) -> None:
    out = _run(2, faults="nan_grad@1:3,forward_exception@0:4", config={"vote_in_hook": False})
    for rank in range(2):
        # without the hook, non-finite gradients are seen only after the reduction,
        # so every rank reports them
        assert _aborts(out[rank]) == {
            3: [("vote", {0: ("nonfinite_grad",), 1: ("nonfinite_grad",)})],
            4: [("vote", {0: ("forward_exception",)})],
        }
        assert _equal(out[rank]["state"], reference[rank]["state"])
        # one explicit vote per attempt, one commit confirmation per committed step
        assert out[rank]["collectives"]["explicit_votes"] == _STEPS + 2
        assert out[rank]["collectives"]["commit_confirmations"] == _STEPS
        assert out[rank]["collectives"]["votes_in_buckets"] == 0


def test_without_2pc_a_failed_update_is_repaired_locally(reference: list[dict[str, Any]]) -> None:
    out = _run(2, faults="optimizer_exception@1:3", config={"two_phase_commit": False})
    assert _aborts(out[0]) == {}  # rank 0 never learns of it
    assert _aborts(out[1]) == {}
    assert len(out[1]["records"][2]["updates"]) == 2  # rank 1 redid its update on its own
    for rank in range(2):
        assert out[rank]["collectives"]["explicit_votes"] == 0
        assert out[rank]["collectives"]["commit_confirmations"] == 0
        assert _equal(out[rank]["state"], reference[rank]["state"])


def test_four_ranks_learn_every_unhealthy_rank_from_one_vote() -> None:
    ref = _run(4, steps=3)
    out = _run(4, steps=3, faults="nan_grad@1:2,forward_exception@3:2")
    for rank in range(4):
        assert _aborts(out[rank]) == {
            2: [("vote", {1: ("nonfinite_grad",), 3: ("forward_exception",)})]
        }
        assert _equal(out[rank]["state"], ref[rank]["state"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ranks_vote_on_device_and_retry_bit_identically() -> None:
    # two ranks share one GPU over Gloo: the vote vector, the loss check and the
    # shadow copy all run on the device; the retry restores the CUDA RNG too
    ref = _run(2, cuda=True)
    out = _run(2, cuda=True, faults="nan_grad@1:2,optimizer_exception@0:3")
    for rank in range(2):
        assert _aborts(out[rank]) == {
            2: [("vote", {1: ("nonfinite_grad",)})],
            3: [("commit", {0: ("step_exception",)})],
        }
        assert _equal(out[rank]["state"], ref[rank]["state"])

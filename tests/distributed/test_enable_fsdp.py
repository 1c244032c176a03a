"""enable_resiliency on FSDP2 (2 and 4 ranks) and HSDP (2 x 2): crash, recover, bit-identical.

Each job runs in generations of fresh processes sharing a node-local folder:
the first trains 7 steps (captures at 3 and 6), then rank 1 is SIGKILLed; the
next generation recovers step 6 and trains to step 11. A reference job trains
11 steps without interruption. The 4-rank generations run the FSDP2 and the
HSDP job one after the other in the same processes (one world, two meshes).
A restore onto another world size fails with a ConfigError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_models import sharded_mlp as _model
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lm_resiliency import ConfigError, InMemoryCkptConfig, enable_resiliency
from lm_resiliency.integrations.fsdp import FSDPAdapter
from lm_resiliency.models import SyntheticTokens
from lm_resiliency.state import decode_state, encode_state
from lm_resiliency.testing import kill_point, run_distributed

_INTERVAL, _CRASH_AFTER, _STEPS = 3, 7, 11


def _mesh(kind: str, world: int) -> Any:
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs).view(-1, 32), targets.reshape(-1))


def _bits(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {f"p/{n}": p.to_local() for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"o/{i}/{k}"] = v.to_local() if hasattr(v, "to_local") else v
    return {k: v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in out.items()}  # fmt: skip


def _job(kind: str, rank: int, world: int, folder: str, stop: int) -> dict[str, Any]:
    mesh = _mesh(kind, world)
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = SyntheticTokens(3, 4, 8, 32, rank=rank, world_size=world)
    torch.manual_seed(20 + rank)
    config = InMemoryCkptConfig(
        disk_folder=f"{folder}/{kind}", run_id=f"{kind}-{world}", disk_flush_interval=_INTERVAL
    )
    resiliency = enable_resiliency(
        model, opt, interval=_INTERVAL, state={"loader": loader}, config=config
    )
    out: dict[str, Any] = {
        "framework": resiliency.adapter.framework,
        "start": resiliency.start_step,
        "source": resiliency.last_recovery.source,
        "slots": sorted(resiliency.manager.slots()),
    }
    for step in range(resiliency.start_step + 1, stop + 1):
        _loss(model, next(loader)).backward()
        opt.step()
        opt.zero_grad()
    out["final"] = _bits(model, opt)
    if stop < _STEPS:
        resiliency.manager.wait_persisted()
        enc = encode_state(resiliency.adapter.state_dict())
        out["adapter_state"] = (enc.document, [t.clone() for t in enc.tensors])
    else:
        resiliency.close()
    return out


def _generation(rank: int, world: int, folder: str, stop: int) -> dict[str, Any]:
    kinds = ["fsdp2", "hsdp"] if world == 4 else ["fsdp2"]
    return {kind: _job(kind, rank, world, folder, stop) for kind in kinds}


def _first_generation(rank: int, world: int, folder: str, ref: str) -> dict[str, Any]:
    """The uninterrupted reference job, then the job whose rank 1 dies after step 7."""
    out = {"reference": _generation(rank, world, ref, _STEPS)}
    # The victim's reference result must outlive it: its final tensors go to a file.
    finals = {
        f"{kind}/{name}": torch.frombuffer(bytearray(bits), dtype=torch.uint8)
        for kind, job in out["reference"].items()
        for name, bits in job["final"].items()
    }
    Path(ref).mkdir(parents=True, exist_ok=True)
    save_file(finals, f"{ref}/final-rank{rank}.safetensors")
    out["crashed"] = _generation(rank, world, folder, _CRASH_AFTER)
    dist.barrier()
    kill_point("crash")  # rank 1 dies here: SIGKILL, no cleanup
    return out


def _reference_final(ref: str, rank: int, kind: str) -> dict[str, bytes]:
    finals = load_file(f"{ref}/final-rank{rank}.safetensors")
    prefix = f"{kind}/"
    return {
        k[len(prefix) :]: v.numpy().tobytes() for k, v in finals.items() if k.startswith(prefix)
    }


def _second_generation(rank: int, world: int, folder: str, saved: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"resumed": _generation(rank, world, folder, _STEPS)}
    if saved is not None:
        out["elsewhere"] = _restore_elsewhere(rank, world, saved)
    return out


def _restore_elsewhere(rank: int, world: int, saved: Any) -> str:
    model = _model(_mesh("fsdp2", world))
    adapter = FSDPAdapter(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)])
    try:
        adapter.load_state_dict(decode_state(*saved))
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    out: dict[int, dict[str, Any]] = {}
    saved = None
    for world in (4, 2):
        folder, ref = str(tmp / f"w{world}"), str(tmp / f"ref{world}")
        kw: dict[str, Any] = {"timeout_s": 180, "pg_timeout_s": 60}
        first = run_distributed(
            _first_generation, world, args=(folder, ref), kill={1: "crash"}, **kw
        )
        second = run_distributed(_second_generation, world, args=(folder, saved), **kw)
        out[world] = {
            "crashed": [None if r is None else r["crashed"] for r in first],
            "reference": [None if r is None else r["reference"] for r in first],
            "resumed": [r["resumed"] for r in second],
            "elsewhere": [r.get("elsewhere") for r in second],
            "ref_dir": ref,
        }
        saved = first[0]["crashed"]["fsdp2"]["adapter_state"]  # world 4's, for world 2
    return out


@pytest.mark.parametrize(("world", "kind"), [(2, "fsdp2"), (4, "fsdp2"), (4, "hsdp")])
def test_a_crashed_sharded_job_resumes_bit_identical(
    jobs: dict[int, dict[str, Any]], world: int, kind: str
) -> None:
    crashed, resumed = jobs[world]["crashed"], jobs[world]["resumed"]
    assert crashed[1] is None  # SIGKILLed (after the reference job and 7 steps of this one)
    for rank in range(world):
        if crashed[rank] is not None:
            assert crashed[rank][kind]["start"] == 0
        mine = resumed[rank][kind]
        assert (mine["framework"], mine["start"], mine["source"]) == (kind, 6, "gemini")
        assert mine["final"] == _reference_final(jobs[world]["ref_dir"], rank, kind)
        assert len(mine["final"]) > 10  # local shards of parameters and AdamW state


def test_hsdp_keeps_two_own_slots_and_no_peer_slots(jobs: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 2, 3):
        assert jobs[4]["reference"][rank]["hsdp"]["slots"] == ["own_current", "own_previous"]
        assert jobs[4]["reference"][rank]["fsdp2"]["slots"] == [
            "own_current", "own_previous", "peer_current", "peer_previous",
        ]  # fmt: skip


def test_a_restore_onto_another_world_size_fails_naming_it(
    jobs: dict[int, dict[str, Any]],
) -> None:
    for message in jobs[2]["elsewhere"]:
        assert "captured with world_size=4 but this job has world_size=2" in message
        assert "durable checkpoint (load_fallback)" in message

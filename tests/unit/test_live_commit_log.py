"""The live commit log's state digest: canonical, split into parts, and read back by check_run."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lm_resiliency.detection.digest import digest_tensors
from lm_resiliency.frontdoor.live import adapter_state_tensors, combine_digests
from lm_resiliency.integrations.module import ModuleAdapter
from lm_resiliency.live.runcheck import check_run


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, dict[str, int]]:
    tensors = adapter_state_tensors(ModuleAdapter(model, [opt]))()
    parts = {k: digest_tensors(v) for k, v in tensors.items()}
    return combine_digests(parts.values()), parts


def test_the_same_optimizer_state_gained_in_another_order_has_the_same_digest() -> None:
    model, opt = _trained()
    twin_model = copy.deepcopy(model)
    twin = torch.optim.AdamW(twin_model.parameters(), lr=1e-2)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    # The twin's optimizer gained its entries last parameter first (as a refill might).
    entries = list(twin.state.items())
    twin.state = defaultdict(dict, reversed(entries))
    assert [id(p) for p in twin.state] != [id(p) for p in twin_model.parameters()]

    def insertion_order(o: torch.optim.Optimizer) -> int:  # what the log digested before
        return digest_tensors(
            [v for s in o.state.values() for _, v in sorted(s.items()) if torch.is_tensor(v)]
        )

    assert insertion_order(opt) != insertion_order(twin)
    assert _digest(model, opt) == _digest(twin_model, twin)


def test_a_changed_value_shows_in_its_part_only() -> None:
    model, opt = _trained()
    whole, parts = _digest(model, opt)
    first = next(iter(model.parameters()))
    with torch.no_grad():
        opt.state[first]["exp_avg"].view(-1)[0] += 1e-3
    whole2, parts2 = _digest(model, opt)
    assert whole2 != whole
    assert [k for k in parts if parts[k] != parts2[k]] == ["optim"]
    with torch.no_grad():
        first.view(-1)[1] += 1e-3
    _, parts3 = _digest(model, opt)
    assert [k for k in parts if parts2[k] != parts3[k]] == ["params"]


def _write_run(folder: Path, optim_of: dict[int, str]) -> None:
    """Two replicas' event logs of one committed step (epoch 0), with these optim digests."""
    for replica, optim in optim_of.items():
        parts = {"params": "aa", "buffers": "bb", "optim": optim}
        who = {"replica": replica, "pid": 100 + replica}
        commit = {"step": 1, "epoch": 0, "members": [0, 1], "digest": f"d-{optim}"}
        records = [
            {"event": "live.start", **who, "step": 0},
            {"event": "live.sample", **who, "step": 1, "epoch": 0, "indices": [replica]},
            {"event": "mtgs.commit", **who, **commit, "digest_parts": parts}
            | ({"attempts": 2} if replica == 1 else {}),
        ]
        path = folder / f"events-replica-{replica}-rank-0.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_check_run_names_the_replicas_and_the_part_that_differ(tmp_path: Path) -> None:
    _write_run(tmp_path, {0: "o1", 1: "o1"})
    assert check_run(tmp_path).final_digest == "d-o1"
    _write_run(tmp_path, {0: "o1", 1: "o2"})
    with pytest.raises(AssertionError) as err:
        check_run(tmp_path)
    text = str(err.value)
    assert "replicas [0]: d-o1; replicas [1]: d-o2" in text
    assert "parts that differ: ['optim']" in text
    assert "attempts per replica {0: 1, 1: 2}" in text

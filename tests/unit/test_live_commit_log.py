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


def _write_heal_run(
    folder: Path, *, fresh1: str = "p0", bound: str = "p2", before: str = "p2"
) -> None:
    """Replicas 0 and 1 commit steps 1-2 (params digest p1, p2); replica 2, healed at step 2,
    commits step 3 with all of them; every first commit says where its process started."""

    def commit(replica: int, step: int, first: dict[str, str] | None) -> list[dict[str, object]]:
        epoch, members = (0, [0, 1]) if step < 3 else (1, [0, 1, 2])
        who = {"replica": replica, "pid": 100 + replica}
        parts = {"params": f"p{step}", "buffers": "b", "optim": f"o{step}"}
        record = {"event": "mtgs.commit", **who, "step": step, "epoch": epoch,
                  "members": members, "digest": f"d{step}", "digest_parts": parts}  # fmt: skip
        if first is not None:
            record["first"] = first
        sample = {"event": "live.sample", **who, "step": step, "epoch": epoch,
                  "indices": [10 * step + replica]}  # fmt: skip
        return [sample, record]

    for replica in (0, 1):
        at = fresh1 if replica == 1 else "p0"
        records = [{"event": "live.start", "replica": replica, "pid": 100 + replica, "step": 0}]
        records += commit(replica, 1, {"params_at_bind": at, "params_before_step": at})
        records += commit(replica, 2, None) + commit(replica, 3, None)
        path = folder / f"events-replica-{replica}-rank-0.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    healed = [{"event": "live.healed", "replica": 2, "pid": 102, "step": 2, "epoch": 1}]
    healed += commit(2, 3, {"params_at_bind": bound, "params_before_step": before})
    path = folder / "events-replica-2-rank-0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in healed))


def test_check_run_names_a_process_that_did_not_start_from_the_committed_state(
    tmp_path: Path,
) -> None:
    _write_heal_run(tmp_path)
    assert check_run(tmp_path).healed == {102: 2}
    _write_heal_run(tmp_path, bound="pX", before="pX")
    with pytest.raises(AssertionError, match=r"replica 2\) started from step 2 with parameters "
                       r"pX, not the p2 every member held after step 2"):  # fmt: skip
        check_run(tmp_path)
    _write_heal_run(tmp_path, before="pY")
    with pytest.raises(AssertionError, match=r"replica 2\): its parameters changed between "
                       r"enable_resiliency and its first optimizer step \(p2 -> pY"):  # fmt: skip
        check_run(tmp_path)
    _write_heal_run(tmp_path, fresh1="pZ")
    different = (
        r"started from different parameters \(digest: replicas\): \{'p0': \[0\], 'pZ': \[1\]\}"
    )
    with pytest.raises(AssertionError, match=different):
        check_run(tmp_path)

"""MTGS pieces without a process group: sampler arguments and state, cgroup limits, tracer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lm_resiliency.errors import ConfigError
from lm_resiliency.transactions import MTGSConfig
from lm_resiliency.transactions.memory_health import (
    cgroup_memory_limit,
    headroom,
    process_rss_bytes,
)
from lm_resiliency.transactions.sampler import ShardedSampler
from lm_resiliency.transactions.tracer import Tracer


def test_sampler_arguments_are_checked_with_the_fix_named() -> None:
    with pytest.raises(ConfigError, match=r"needs num_replicas= and rank= when no process group"):
        ShardedSampler(10)
    with pytest.raises(ConfigError, match=r"rank=2, num_replicas=2\): rank must be in 0\.\.1"):
        ShardedSampler(10, rank=2, num_replicas=2)
    with pytest.raises(ConfigError, match=r"a dataset of 3 samples leaves no sample for each of 4"):
        ShardedSampler(3, rank=0, num_replicas=4)


def test_sampler_shards_partition_the_dataset_and_rewind_a_running_loader() -> None:
    shards = [ShardedSampler(11, rank=r, num_replicas=3, seed=1).shard() for r in range(3)]
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [3, 3, 3] and len(set(flat)) == 9  # 11 % 3 dropped
    sampler = ShardedSampler(list(range(40)), rank=1, num_replicas=2, seed=4)
    batches = iter(DataLoader(list(range(40)), batch_size=4, sampler=sampler))
    first = next(batches)
    state = sampler.state_dict()
    assert state["position"] == 4 and state["epoch"] == 0
    second = next(batches)
    sampler.load_state_dict(state)  # the iterator already running is rewound
    assert torch.equal(next(batches), second) and not torch.equal(first, second)
    other = ShardedSampler(40, rank=1, num_replicas=2, seed=5)
    with pytest.raises(ConfigError, match=r"state has seed=4 but this sampler has seed=5"):
        other.load_state_dict(state)
    rest = list(batches)
    assert len(rest) == 3 and sampler.state_dict()["position"] == 20  # the epoch is done
    assert len(list(DataLoader(list(range(40)), batch_size=4, sampler=sampler))) == 5
    sampler.set_epoch(1)
    assert sampler.shard() != ShardedSampler(40, rank=1, num_replicas=2, seed=4).shard()


def _tree(root: Path, *, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    proc = root / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "statm").write_text("1000 250 10 1 0 100 0\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc


def test_cgroup_v2_limit_is_the_smallest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    proc = _tree(
        tmp_path,
        cgroup="0::/job/rank0\n",
        mountinfo="30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        files={
            "sys/fs/cgroup/job/memory.max": "1073741824\n",
            "sys/fs/cgroup/job/rank0/memory.max": "max\n",
        },
    )
    assert cgroup_memory_limit(proc, prefix=tmp_path) == 2**30
    (tmp_path / "sys/fs/cgroup/job/memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc, prefix=tmp_path) is None  # no limit: no vote


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path: Path) -> None:
    proc = _tree(
        tmp_path,
        cgroup="4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n",
        mountinfo=(
            "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        ),
        files={"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "536870912\n"},
    )
    assert cgroup_memory_limit(proc, prefix=tmp_path) == 2**29
    path = tmp_path / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"
    path.write_text("9223372036854771712\n")
    assert cgroup_memory_limit(proc, prefix=tmp_path) is None


def test_this_hosts_cgroup_files_and_rss_are_read() -> None:
    rss = process_rss_bytes()
    status = Path("/proc/self/status").read_text()
    vm_rss = next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS"))
    assert abs(rss - vm_rss) < 64 * 2**20
    limit = cgroup_memory_limit()
    assert limit is None or limit > rss
    room = headroom(torch.device("cpu"), limit_bytes=rss // 2)  # a limit the RSS crosses
    assert room is not None and room.fraction < 0 and "cpu:" in room.describe()
    if limit is None:
        assert headroom(torch.device("cpu")) is None


def test_memory_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"min_memory_headroom=1\.5 must be a fraction"):
        MTGSConfig(min_memory_headroom=1.5)
    with pytest.raises(ConfigError, match=r"memory_limit_bytes=0 must be a byte count"):
        MTGSConfig(memory_limit_bytes=0)


def test_the_tracer_refuses_an_unknown_phase_and_writes_chrome_json(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json", rank=3)
    with pytest.raises(ValueError, match=r"unknown MTGS trace phase 'warmup'; use one of"):
        tracer.start("warmup")
    tracer.end(tracer.start("vote"), step=1, attempt=0)
    tracer.close()
    doc = json.loads((tmp_path / "t.json").read_text())
    (event,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert event["name"] == "vote" and event["pid"] == 3
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_headroom_is_free_over_total_device_memory() -> None:
    device = torch.device("cuda", 0)
    room = headroom(device, limit_bytes=1)  # the CPU limit plays no part on a device
    _, total = torch.cuda.mem_get_info(device)
    assert room is not None and room.where == "cuda:0" and room.limit_bytes == total
    assert 0 < room.fraction <= 1

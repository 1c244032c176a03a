"""The global-batch sampler of live membership: every sample exactly once for any membership."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lm_resiliency.errors import ConfigError
from lm_resiliency.live.sampler import (
    GlobalBatchSampler,
    SampledBatch,
    Share,
    check_loader,
    global_indices,
    reseed_step,
    split,
    step_seed,
    weight,
)
from lm_resiliency.telemetry import EventLog


@dataclass
class Source:
    """The share source the front door will provide, as a plain object."""

    step: int = 1
    index: int = 0
    count: int = 1
    epoch: int = 0
    member: int | None = None

    def current(self) -> Share:
        return Share(self.step, self.index, self.count, self.epoch, self.member)


class Ids(Dataset[int]):
    """Sample ``i`` is the id ``i`` itself, so a batch shows which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_global_indices_walk_one_permutation_per_epoch_and_straddle_exactly() -> None:
    n, b = 10, 4
    steps = [global_indices(7, s, n, b) for s in range(1, 11)]  # 40 samples: 4 epochs
    flat = [i for step in steps for i in step]
    for e in range(4):
        assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
    # Step 3 covers positions 8..11: the last 2 of epoch 0 and the first 2 of epoch 1.
    assert steps[2][:2] == flat[8:10] and steps[2][2:] == flat[10:12]
    assert flat[:n] != flat[n : 2 * n]  # each epoch has its own permutation
    # A global batch larger than the dataset spans whole epochs.
    big = global_indices(7, 1, 3, 7)
    assert sorted(big[:3]) == sorted(big[3:6]) == [0, 1, 2]


def test_global_indices_are_a_pure_function_of_seed_and_step_in_any_process() -> None:
    here = [global_indices(3, s, 1000, 64) for s in (1, 16, 17, 40)]
    code = (
        "from lm_resiliency.live.sampler import global_indices, step_seed;"
        "print([global_indices(3, s, 1000, 64) for s in (1, 16, 17, 40)]);"
        "print(step_seed(3, 5, 1, 4))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out[0] == str(here)
    assert int(out[1]) == step_seed(3, 5, 1, 4)
    assert global_indices(4, 1, 1000, 64) != here[0]


@pytest.mark.parametrize(("b", "count"), [(8, 4), (7, 3), (5, 5), (9, 2), (3, 1)])
def test_split_is_strided_covers_the_batch_and_sizes_differ_by_at_most_one(
    b: int, count: int
) -> None:
    batch = global_indices(0, 2, 50, b)
    shares = [split(batch, i, count) for i in range(count)]
    assert sorted(i for s in shares for i in s) == sorted(batch)
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    assert shares[0] == batch[0::count]
    assert sum(weight(n, b) for n in sizes) == pytest.approx(1.0, abs=1e-15)
    assert weight(sizes[0], b, "sum") == 1 / b


def _grad(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    model.zero_grad()
    per_sample = ((model(x) - y) ** 2).sum(dim=1)
    (per_sample.mean() if reduction == "mean" else per_sample.sum()).backward()
    assert model.weight.grad is not None and model.bias.grad is not None
    return torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]).clone()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_weighted_member_gradients_sum_to_the_global_mean_gradient(
    reduction: str, count: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    n, b = 40, 7
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    model = torch.nn.Linear(3, 2).double()
    batch = global_indices(1, 4, n, b)
    reference = _grad(model, x[batch], y[batch], "mean")
    total = torch.zeros_like(reference)
    for i in range(count):
        mine = split(batch, i, count)
        total += weight(len(mine), b, reduction) * _grad(model, x[mine], y[mine], reduction)
    torch.testing.assert_close(total, reference, rtol=1e-12, atol=1e-14)


class Replica:
    """One data-parallel replica's sampler and loader, as the training loop would drive it."""

    def __init__(self, r: int, n: int, b: int, seed: int, log: list[SampledBatch]) -> None:
        self.r = r
        self.source = Source(member=r)
        self.sampler = GlobalBatchSampler(n, b, seed, self.source, on_batch=log.append)
        self.batches = iter(DataLoader(Ids(n), batch_sampler=self.sampler, collate_fn=list))

    def draw(self, step: int, members: list[int], epoch: int) -> list[int]:
        self.source.step, self.source.epoch = step, epoch
        self.source.index, self.source.count = members.index(self.r), len(members)
        return list(next(self.batches))


@dataclass
class Run:
    """A simulated job: replicas join, leave and are lost mid-step; steps are redone."""

    n: int
    b: int
    seed: int
    steps: int
    log: list[SampledBatch] = field(default_factory=list)
    committed: dict[int, dict[int, list[int]]] = field(default_factory=dict)

    def play(self, rng: random.Random, replicas: int = 4) -> None:
        live = {r: Replica(r, self.n, self.b, self.seed, self.log) for r in range(replicas)}
        epoch = 0
        for step in range(1, self.steps + 1):
            members = sorted(live)
            # A replica lost inside this step: its draw happened, the step is redone by the
            # others under a new epoch (possibly more than once).
            while len(members) > 1 and rng.random() < 0.25:
                for r in members:
                    live[r].draw(step, members, epoch)
                lost = rng.choice(members)
                del live[lost]
                members.remove(lost)
                epoch += 1
            got = {r: live[r].draw(step, members, epoch) for r in members}
            self.committed[step] = got
            # At the boundary after the commit: a clean leave, or an admission healed from a
            # donor (the joiner's sampler takes the donor's position).
            if len(live) > 1 and rng.random() < 0.15:
                del live[rng.choice(sorted(live))]
                epoch += 1
            absent = [r for r in range(replicas) if r not in live]
            if absent and rng.random() < 0.3:
                joiner = Replica(rng.choice(absent), self.n, self.b, self.seed, self.log)
                joiner.sampler.load_state_dict(live[min(live)].sampler.state_dict())
                live[joiner.r] = joiner
                epoch += 1


def _assert_exactly_once(run: Run) -> None:
    per_epoch: Counter[tuple[int, int]] = Counter()
    position = 0
    for step in range(1, run.steps + 1):
        batch = global_indices(run.seed, step, run.n, run.b)
        consumed = [i for share in run.committed[step].values() for i in share]
        assert sorted(consumed) == sorted(batch), f"step {step}: {run.committed[step]}"
        sizes = [len(s) for s in run.committed[step].values()]
        assert sum(weight(k, run.b) for k in sizes) == pytest.approx(1.0, abs=1e-12)
        for i in batch:
            per_epoch[(position // run.n, i)] += 1
            position += 1
    assert set(per_epoch.values()) == {1}
    # Aborted draws were shares of the same global batch too (the redo re-splits it).
    for rec in run.log:
        assert set(rec.indices) <= set(global_indices(run.seed, rec.step, run.n, run.b))


def test_every_sample_is_consumed_exactly_once_for_random_member_schedules() -> None:
    rng = random.Random(2024)
    for trial in range(150):
        run = Run(n=rng.randint(4, 40), b=rng.randint(4, 13), seed=trial, steps=rng.randint(5, 25))
        run.play(rng)
        _assert_exactly_once(run)


def test_four_to_three_and_back_with_a_redo_under_the_new_membership() -> None:
    n, b, seed = 30, 8, 5
    log: list[SampledBatch] = []
    reps = {r: Replica(r, n, b, seed, log) for r in range(4)}
    committed: dict[int, list[int]] = {}
    members, epoch = [0, 1, 2, 3], 0
    for step in range(1, 13):
        if step == 5:  # replica 2 is lost inside step 5: everyone drew, step 5 is redone
            for r in members:
                reps[r].draw(step, members, epoch)
            members, epoch = [0, 1, 3], epoch + 1
        if step == 9:  # replica 2 is healed from replica 0 and admitted at step 9
            reps[2] = Replica(2, n, b, seed, log)
            reps[2].sampler.load_state_dict(reps[0].sampler.state_dict())
            members, epoch = [0, 1, 2, 3], epoch + 1
        committed[step] = sorted(i for r in members for i in reps[r].draw(step, members, epoch))
        assert committed[step] == sorted(global_indices(seed, step, n, b))
    redo = [rec for rec in log if rec.step == 5]
    assert [(rec.epoch, rec.member, rec.count) for rec in redo] == [
        (0, 0, 4), (0, 1, 4), (0, 2, 4), (0, 3, 4), (1, 0, 3), (1, 1, 3), (1, 3, 3),
    ]  # fmt: skip
    assert {rec.count for rec in log if 5 < rec.step < 9} == {3}


def test_dataloader_yields_each_members_share_and_ends_after_steps() -> None:
    n, b, seed, steps = 23, 6, 11, 9
    sources = [Source(index=i, count=3, member=i) for i in range(3)]
    samplers = [GlobalBatchSampler(n, b, seed, s, steps=steps) for s in sources]
    loaders = [DataLoader(Ids(n), batch_sampler=s) for s in samplers]
    assert [len(loader) for loader in loaders] == [steps] * 3
    for loader in loaders:
        check_loader(loader)
    seen: dict[int, list[int]] = {}
    for i, loader in enumerate(loaders):
        for batch in loader:  # the plain loop; the "commit" advances the source's step
            assert isinstance(batch, torch.Tensor)
            seen.setdefault(sources[i].step, []).extend(batch.tolist())
            assert batch.tolist() == split(global_indices(seed, sources[i].step, n, b), i, 3)
            sources[i].step += 1
    assert sorted(seen) == list(range(1, steps + 1))
    for step, ids in seen.items():
        assert sorted(ids) == sorted(global_indices(seed, step, n, b))
    assert [s.served for s in samplers] == [steps] * 3
    assert len(samplers[0]) == 0


def test_state_dict_resumes_the_position_and_the_event_log_records_each_batch() -> None:
    events = EventLog()
    src = Source(member=3, index=1, count=2, epoch=4)
    sampler = GlobalBatchSampler(20, 4, 0, src, events=events)
    it = iter(sampler)
    first = next(it)
    src.step = 2
    next(it)
    state = sampler.state_dict()
    assert state["served"] == 2
    assert events.records[0]["event"] == "live.sample"
    assert {k: events.records[0][k] for k in ("step", "epoch", "member", "index", "count")} == {
        "step": 1, "epoch": 4, "member": 3, "index": 1, "count": 2,
    }  # fmt: skip
    assert events.records[0]["indices"] == first

    restored = GlobalBatchSampler(20, 4, 0, Source(step=3, member=3, index=1, count=2, epoch=4))
    restored.load_state_dict(state)
    assert next(iter(restored)) == split(global_indices(0, 3, 20, 4), 1, 2)
    fresh = GlobalBatchSampler(20, 4, 0, Source(step=3))
    with pytest.raises(ConfigError, match="asked for the batch of step 3 but the next step is 1"):
        next(iter(fresh))


def test_prefetching_loader_and_skipped_steps_are_refused_with_the_fix() -> None:
    src = Source()
    loader = DataLoader(Ids(16), batch_sampler=GlobalBatchSampler(16, 4, 0, src), num_workers=2)
    with pytest.raises(ConfigError, match=r"num_workers=2\) draws 4 batches ahead"):
        check_loader(loader)
    with pytest.raises(ConfigError, match=r"asked twice for the batch of step 1.*num_workers=0"):
        iter(loader)  # the loader draws prefetch_factor * num_workers batches at once
    sampler = GlobalBatchSampler(16, 4, 0, src)
    it = iter(sampler)
    next(it)
    src.step = 3
    with pytest.raises(ConfigError, match="asked for the batch of step 3 but the next step is 2"):
        next(it)


class OwnIndexed:
    def indices_for(self, step: int, index: int, count: int) -> list[int]:
        return split(global_indices(0, step, 100, 8), index, count)


class OwnStateful:
    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass

    def reshard(self, index: int, count: int) -> None:
        pass


def test_check_loader_accepts_the_two_protocols_and_names_the_type_and_fixes_otherwise() -> None:
    check_loader(OwnIndexed())
    check_loader(OwnStateful())
    with pytest.raises(ConfigError) as err:
        check_loader(iter(range(10)))
    text = str(err.value)
    assert "range_iterator" in text
    assert "indices_for(step, index, count)" in text and "reshard(index, count)" in text
    with pytest.raises(ConfigError, match="DataLoader with batch_sampler BatchSampler cannot"):
        check_loader(DataLoader(Ids(10), batch_size=2))
    with pytest.raises(ConfigError, match="pass it as DataLoader\\(dataset, batch_sampler=sampler"):
        check_loader(DataLoader(Ids(10), sampler=GlobalBatchSampler(10, 2, 0, Source())))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: global_indices(0, 0, 10, 2), "step=0 must be an int >= 1"),
        (lambda: global_indices(0, 1, 0, 2), "dataset_len=0 must be an int >= 1"),
        (lambda: global_indices(0, 1, 10, 0), "global_batch=0 must be an int >= 1"),
        (lambda: split([1, 2], 0, 3), "3 members cannot split a global batch of 2 samples"),
        (lambda: split([1, 2], 2, 2), r"member index=2 must be an int in \[0, 2\)"),
        (lambda: weight(1, 4, "avg"), "loss_reduction='avg' is not one of mean, sum"),
        (lambda: weight(5, 4), r"n_local=5 must be an int in \[0, global_batch=4\]"),
        (lambda: GlobalBatchSampler(10, 2, 0, object()), "object has no current\\(\\) method"),  # type: ignore[arg-type]
        (lambda: len(GlobalBatchSampler(10, 2, 0, Source())), "endless and has no len"),
    ],
)
def test_bad_inputs_raise_naming_the_value_and_the_fix(call: object, fragment: str) -> None:
    with pytest.raises((ConfigError, TypeError), match=fragment):
        call()  # type: ignore[operator]


def test_state_of_another_stream_is_refused() -> None:
    state = GlobalBatchSampler(10, 2, 0, Source()).state_dict()
    with pytest.raises(ConfigError, match="sampler state has seed=0 but this sampler has seed=1"):
        GlobalBatchSampler(10, 2, 1, Source()).load_state_dict(state)
    with pytest.raises(ConfigError, match="not a GlobalBatchSampler state"):
        GlobalBatchSampler(10, 2, 0, Source()).load_state_dict({"served": 3})


def test_reseed_step_pins_torch_and_only_on_request_python_and_numpy() -> None:
    reseed_step(9, 4, 1, 3)
    a = torch.rand(3)
    py_before = random.random()
    reseed_step(9, 4, 1, 3)
    assert torch.equal(torch.rand(3), a)
    assert random.random() != py_before  # untouched: the stream went on
    reseed_step(9, 4, 2, 3)
    assert not torch.equal(torch.rand(3), a)
    reseed_step(9, 4, 1, 3, python_and_numpy=True)
    p, q = random.random(), np.random.random()
    reseed_step(9, 4, 1, 3, python_and_numpy=True)
    assert (random.random(), np.random.random()) == (p, q)
    assert len({step_seed(9, s, i, m) for s in (1, 2) for i, m in ((0, 1), (0, 2), (1, 2))}) == 6


@dataclass
class FlakySource(Source):
    """A share source whose first ``fail`` reads raise (a membership read that failed)."""

    fail: int = 1

    def current(self) -> Share:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("membership read failed")
        return super().current()


def test_a_failed_draw_leaves_the_loader_usable_for_the_retry_of_the_step() -> None:
    # MTGS retries an aborted step with the same DataLoader iterator. A generator sampler
    # ended at the first exception, and every retry then got a bare StopIteration (an abort
    # with an empty message), never the batch and never the real error.
    n, b, seed = 20, 4, 3
    src = FlakySource(step=6, index=1, count=2)
    sampler = GlobalBatchSampler(n, b, seed, src, steps=12)
    sampler.load_state_dict({**sampler.state_dict(), "served": 5})  # recovered step 5
    batches = iter(DataLoader(Ids(n), batch_sampler=sampler, num_workers=0))
    with pytest.raises(RuntimeError, match="membership read failed"):
        next(batches)
    assert next(batches).tolist() == split(global_indices(seed, 6, n, b), 1, 2)  # the retry
    # A position error stays that error at every retry (not StopIteration after the first).
    stale = GlobalBatchSampler(n, b, seed, Source(step=6), steps=12)
    it = iter(DataLoader(Ids(n), batch_sampler=stale, num_workers=0))
    for _ in range(3):
        with pytest.raises(ConfigError, match="asked for the batch of step 6 but the next step"):
            next(it)
    # The end of the run is still the end of the iteration.
    src.step = 13
    with pytest.raises(StopIteration):
        next(batches)

"""No false alarm: hundreds of clean checks on several model shapes, with and without DDP,
report no SDC, and training with SCOUT checking every step is bit-identical to training
without it (the replays leave RNG, buffers, gradients and optimizer state untouched)."""

from __future__ import annotations

import torch
from scout_fixtures import MODELS, Trainer, digest

from lm_resiliency.detection import Scout, ScoutConfig, ScoutStatus
from lm_resiliency.testing import run_distributed

STEPS = 22
CONFIGS = [
    (name, ddp) for name in ("gpt", "mlp", "frozen", "dropout", "buffers") for ddp in (True, False)
]


def _train(name: str, rank: int, world: int, ddp: bool, with_scout: bool) -> tuple[str, list]:
    t = Trainer(name, rank=rank, world=world, ddp=ddp)
    scout = Scout(ScoutConfig(interval=1), t.net) if with_scout else None
    results = []
    for step in range(1, STEPS + 1):
        t.step()
        if scout is not None:
            r = scout.check(step)
            results.append((r.status, r.faulty_ranks, r.capture_allowed, r.recipe, r.reason))
    if scout is not None:
        scout.close()
    after = {
        "state": t.state(STEPS),
        "buffers": dict(t.model.named_buffers()),
        "grads": [p.grad for p in t.model.parameters()],
        "cpu_rng": torch.get_rng_state(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    return digest(after), results


def _clean(rank: int, world: int) -> dict:
    out = {}
    for name, ddp in CONFIGS:
        plain, _ = _train(name, rank, world, ddp, with_scout=False)
        checked, results = _train(name, rank, world, ddp, with_scout=True)
        out[(name, ddp)] = {"identical": plain == checked, "results": results}
    return out


def test_no_false_alarm_and_no_perturbation_across_model_shapes_with_and_without_ddp() -> None:
    out = run_distributed(_clean, 3, timeout_s=280)
    total = 0
    for rank, per_rank in enumerate(out):
        assert set(per_rank) == set(CONFIGS)
        for key, o in per_rank.items():
            assert o["identical"], f"rank {rank} {key}: SCOUT changed the training"
            for status, faulty, allowed, recipe, reason in o["results"]:
                assert status not in (ScoutStatus.SDC, ScoutStatus.INCONCLUSIVE), (key, reason)
                assert faulty == () and allowed, (key, recipe, reason)
                assert "dense[" in recipe and "optimizer[" in recipe, (key, recipe)
            total += len(o["results"])
    assert total // len(out) == STEPS * len(CONFIGS) >= 200  # checks per rank
    # Every block of every model was replayed at least once (rotation covers the catalog).
    for key, o in out[0].items():
        replayed = {r[3].split()[0] for r in o["results"]}
        assert len(replayed) >= 3, (key, replayed)


def test_every_model_shape_gets_recipes_from_its_blocks() -> None:
    from lm_resiliency.detection.blocks import partition

    labels = {name: [b.label for b in partition(make())] for name, make in MODELS.items()}
    assert labels["gpt"] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    assert labels["mlp"] == ["0", "2", "4"]  # no embedding, no head: still recipes
    assert labels["buffers"] == ["0", "1", "2", "3"]
    assert labels["moe"] == [
        "inp",
        "router",
        "experts.0",
        "experts.1",
        "experts.2",
        "experts.3",
        "out",
    ]

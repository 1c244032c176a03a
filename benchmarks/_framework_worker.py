"""Worker of benchmarks/frameworks.py, run by torchrun on 2 CPU ranks (Gloo).

``python _framework_worker.py --framework {deepspeed,megatron,torchtitan} --out FILE ...``

In one process: warm-up steps, then ``--steps`` plain steps (baseline), then
resiliency enabled at ``--interval`` and ``--steps`` more steps. Rank 0 writes
steps/s of both phases and the blocking time of every capture (state_dict +
save at the boundary + the wait before the next step) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
_TESTS = Path(__file__).resolve().parents[1] / "tests" / "frameworks"
sys.path.insert(0, str(_TESTS))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lm_resiliency.config import InMemoryCkptConfig  # noqa: E402
from lm_resiliency.distributed import init_process_group  # noqa: E402

Step = Callable[[int], None]


def deepspeed_setup(args: argparse.Namespace) -> tuple[Any, Step]:
    import deepspeed

    from lm_resiliency.integrations.deepspeed import make_adapter

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    w = args.width
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(w, w), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = dist.get_rank()

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(8, w, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()

    return make_adapter(engine, []), step


def megatron_setup(args: argparse.Namespace) -> tuple[Any, Step]:
    import megatron_cpu_shim  # test-only CPU shim, see its doc

    megatron_cpu_shim.install()
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from lm_resiliency.integrations.megatron import make_adapter

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.width,
        num_attention_heads=4,
        use_cpu_initialization=True,
    )
    vocab, seq = 256, 32
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq)
    chunk = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, use_distributed_optimizer=True),
        [chunk],
    )
    rank = dist.get_rank()
    positions = torch.arange(seq).unsqueeze(0).expand(4, seq)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(0, vocab, (4, seq), generator=g)
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = chunk(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        finalize_model_grads([chunk])
        optimizer.step()

    return make_adapter([chunk], [], optimizer=optimizer), step


def torchtitan_setup(args: argparse.Namespace) -> tuple[Any, Step]:
    import torchtitan_cpu_shim  # test-only CPU shim, see its doc

    torchtitan_cpu_shim.install()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from lm_resiliency.integrations.torchtitan import make_adapter

    cfg = llama3_debugmodel()  # 6.2M parameters, random init
    cfg.hf_assets_path = str(args.assets / "tokenizer")
    cfg.dataloader.dataset_path = str(args.assets / "data")
    cfg.training.seq_len = 128
    cfg.training.local_batch_size = 2
    cfg.training.steps = 10_000  # the LR schedule's length; the phases run far fewer
    cfg.training.disable_cuda_graphs = True
    cfg.training.mixed_precision_param = "float32"
    cfg.parallelism.data_parallel_shard_degree = 2
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.debug.seed = 0
    cfg.validator.enable = False
    cfg.metrics.log_freq = 10**9
    cfg.dump_folder = tempfile.mkdtemp(prefix="lmr-bench-titan-")
    trainer = cfg.build()
    torchtitan_cpu_shim.force_sum_reduction(trainer.model_parts)
    batches = trainer.batch_generator(trainer.dataloader)

    def step(i: int) -> None:
        # One iteration of Trainer.train()'s loop body (its train_step, TorchTitan's own).
        trainer.step += 1
        trainer.train_step(batches)

    return make_adapter(trainer, []), step


def _phase(step: Step, first: int, count: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(first, first + count):
        step(i)
    dist.barrier()
    return count / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["deepspeed", "megatron", "torchtitan"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--assets", type=Path, help="torchtitan: tokenizer and dataset folder")
    args = p.parse_args()
    init_process_group("gloo")
    setups = {"deepspeed": deepspeed_setup, "megatron": megatron_setup}
    setup = setups.get(args.framework, torchtitan_setup)
    adapter, step = setup(args)
    from lm_resiliency.frontdoor.enable import enable_adapter

    _phase(step, 1, 5)  # warm-up: allocator, optimizer state, first-step layouts
    baseline = _phase(step, 6, args.steps)
    disk = tempfile.mkdtemp(prefix="lmr-bench-")
    config = InMemoryCkptConfig(
        interval=args.interval,
        disk_folder=disk,
        disk_flush_interval=0,
        pin_memory=False,
        run_id=f"bench-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}",
    )
    handle = enable_adapter(adapter, config=config)
    profile = os.environ.get("LMR_BENCH_PROFILE")  # a file: cProfile of rank 0's capture hooks
    if profile and dist.get_rank() == 0:
        _profile_boundary(handle, Path(profile))
    gemini = _phase(step, 6 + args.steps, args.steps)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in _tensors(adapter.state_dict())  # what one capture copies
    )
    handle.close()
    if dist.get_rank() == 0:
        result = {
            "framework": args.framework,
            "baseline_steps_per_s": baseline,
            "gemini_steps_per_s": gemini,
            "blocking_s": handle.stats.per_capture_s(),
            "launch_s": handle.stats.launch_s,
            "wait_s": handle.stats.wait_s,
            "state_bytes_per_rank": state_bytes,
        }
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _profile_boundary(handle: Any, out: Path) -> None:
    """Profile every capture's post-step hook (its launch) into ``out`` (pstats text)."""
    import cProfile
    import io
    import pstats

    boundary = handle._boundary
    prof = cProfile.Profile()
    launch = boundary.after_step

    def after_step() -> None:
        capture = (boundary.step + 1) % handle.interval == 0
        if capture:
            prof.enable()
        try:
            launch()
        finally:
            if capture:
                prof.disable()
                text = io.StringIO()
                stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
                stats.print_stats(30)
                stats.print_callers(8)
                out.write_text(text.getvalue())

    boundary.after_step = after_step


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


if __name__ == "__main__":
    sys.exit(main())

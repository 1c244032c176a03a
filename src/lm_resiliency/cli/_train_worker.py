"""One rank of ``lm-resiliency train`` / ``python -m mtgs.trainer`` (started by the launcher).

Usage (by the launcher only): ``python -m lm_resiliency.cli._train_worker RUN_JSON``.
Reads the run settings from ``RUN_JSON`` (written by :mod:`lm_resiliency.cli.train`),
joins the Gloo group torchrun's agent set up, trains, and writes
``result-rank<R>.json``, ``events-rank<R>.jsonl`` and ``ettr-rank<R>.csv`` next
to it. Rank 0 prints one line per step that was not a plain commit.
Exit code 0 on success, 1 when the training ended with an error.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lm_resiliency.faults import FaultInjector
from lm_resiliency.models import GPTConfig, SyntheticTokens, TinyGPT
from lm_resiliency.models.hf import DistilBertLM
from lm_resiliency.telemetry import EttrTimer, EventLog, ThroughputMeter
from lm_resiliency.transactions import MTGS, MTGSConfig, StepResult
from lm_resiliency.transactions.tracer import Tracer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run = json.loads(Path(argv[0]).read_text())
    out_dir = Path(run["log_dir"])
    torch.set_num_threads(int(run["threads"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(run["pg_timeout_s"])))
    rank, world = dist.get_rank(), dist.get_world_size()
    events = EventLog(out_dir / f"events-rank{rank}.jsonl", rank=rank)
    ettr = EttrTimer(rank)
    result: dict[str, Any] = {"rank": rank, "world_size": world, "mode": run["mode"]}
    code = 0
    try:
        result.update(_train(run, rank, world, events, ettr))
    except Exception as exc:  # reported to the parent through the result file, then exit 1
        code = 1
        result["error"] = f"{type(exc).__name__}: {exc}"
        events.log("train.error", error=result["error"])
        print(f"[rank {rank}] training failed: {result['error']}", file=sys.stderr, flush=True)
        if os.environ.get("LM_RESILIENCY_TRACEBACK") == "1":
            traceback.print_exc()
    finally:
        result["ettr_ns"] = ettr.durations_ns()
        ettr.to_csv(out_dir / f"ettr-rank{rank}.csv")
        ettr.to_jsonl(out_dir / f"ettr-rank{rank}.jsonl")
        (out_dir / f"result-rank{rank}.json").write_text(json.dumps(result))
        events.close()
    if code == 0:
        # The DDP reducer holds the group: destroy_process_group() only stops its Gloo
        # threads once nothing holds the model. torch's lazy import inside DDP.__init__
        # leaves cyclic garbage whose frames hold the model, so collect it first: the group
        # must go now, not in the GC of interpreter shutdown, where a Gloo thread freeing a
        # work cannot take the GIL and the process dies in std::terminate.
        gc.collect()
        dist.destroy_process_group()
    return code


def _model(run: dict[str, Any]) -> nn.Module:
    torch.manual_seed(int(run["seed"]))
    if run["model"] == "distilbert":
        width = int(run["width"])
        return DistilBertLM(
            vocab_size=int(run["vocab"]),
            n_layers=int(run["layers"]),
            dim=width,
            hidden_dim=4 * width,
            max_position_embeddings=max(512, int(run["seq_len"])),
        )
    return TinyGPT(
        GPTConfig(
            vocab_size=int(run["vocab"]),
            block_size=int(run["seq_len"]),
            n_layer=int(run["layers"]),
            n_embd=int(run["width"]),
        )
    )


def _train(
    run: dict[str, Any], rank: int, world: int, events: EventLog, ettr: EttrTimer
) -> dict[str, Any]:
    model = _model(run)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(run["lr"]))
    warmup = 3
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    data = SyntheticTokens(
        int(run["seed"]),
        int(run["batch_size"]),
        int(run["seq_len"]),
        int(run["vocab"]),
        rank=rank,
        world_size=world,
    )
    faults = None
    if run["faults"]:
        faults = FaultInjector(run["faults"], rank=rank, events=events)
        faults.arm()  # --faults on the command line is the explicit opt-in
        faults.install(model, optimizer)

    def closure() -> torch.Tensor:
        x, y = next(data)
        loss: torch.Tensor = ddp(x, y)
        return loss

    meter = ThroughputMeter(warmup_steps=1)
    steps = int(run["steps"])
    losses: list[float] = []
    aborts = retries = rollbacks = repairs = 0
    meter.start()
    if run["mode"] == "baseline":
        for step in range(1, steps + 1):
            if faults is not None:
                faults.at_attempt(step, 0)
            loss = closure()
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            meter.step(data.tokens_per_batch * world)
            losses.append(float(loss.detach()))
    else:
        config = MTGSConfig(
            max_retries=int(run["max_retries"]),
            vote_in_hook=not run["disable_hook"],
            shadow=not run["disable_shadow"],
            two_phase_commit=not run["disable_2pc"],
            force_abort_steps=frozenset(run["force_abort_steps"]),
        )
        trace = Path(run["log_dir"]) / f"trace-rank{rank}.json"
        tracer = Tracer(trace, rank=rank) if run.get("trace") else None
        txn = MTGS(
            ddp,
            optimizer,
            scheduler,
            config=config,
            data_state=data,
            faults=faults,
            events=events,
            ettr=ettr,
            tracer=tracer,
        )
        try:
            for _ in range(steps):
                result = txn.step(closure)
                meter.step(data.tokens_per_batch * world if result.committed else 0)
                aborts += len(result.aborts)
                retries += result.retries
                rollbacks += sum(a.phase == "commit" for a in result.aborts)
                if result.loss is not None:
                    losses.append(float(result.loss))
                if rank == 0 and result.aborts:
                    print(_describe(result, steps), flush=True)
        finally:
            if tracer is not None:
                tracer.close()  # a failed run keeps its trace too
        repairs = txn.local_repairs
        txn.close()
        events.log("train.collectives", **txn.collectives)
    return {
        "steps": steps,
        "losses": losses,
        "aborts": aborts,
        "retries": retries,
        "rollbacks": rollbacks,
        "local_repairs": repairs,
        "tokens_per_s": meter.tokens_per_s,
    }


def _describe(result: StepResult, steps: int) -> str:
    parts = []
    for a in result.aborts:
        who = "; ".join(f"rank {r}: {'+'.join(n)}" for r, n in a.reasons.items())
        what = "rolled back" if a.phase == "commit" else "aborted"
        parts.append(
            f"attempt {a.attempt + 1} {what} ({a.phase} phase: {who}), "
            f"ETTR {a.ettr_ns / 1e6:.3f} ms"
        )
    end = f"committed on attempt {result.attempts}" if result.committed else "skipped"
    return f"[mtgs] step {result.step}/{steps}: " + "; ".join(parts) + f" -> retried, {end}"


if __name__ == "__main__":
    sys.exit(main())

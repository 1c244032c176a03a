"""``lm-resiliency train`` (also ``python -m mtgs.trainer``): a short DDP training run with MTGS.

Starts ``--nproc`` ranks through torchrun's elastic launcher (c10d rendezvous
on 127.0.0.1, a free port, Gloo on CPU), trains the tiny GPT model on
synthetic tokens, and prints the aborts, retries, rollbacks, the local repairs
(without 2PC a rank redoes a failed update from its shadow, counted over every
rank), rank 0's ETTR of each abort or repair (effective time to recovery: from
detecting the bad step to being ready to run it again) and the throughput::

    python -m mtgs.trainer --mode baseline --steps 5
    python -m mtgs.trainer --mode mtgs --steps 5 --mtgs-force-abort-step 2
    python -m mtgs.trainer --mode mtgs --faults nan_grad@1:3,optimizer_exception@0:4

Exit code 0 when every rank finished with a finite loss, 1 when training
failed (the error of each failed rank is printed) or the loss is NaN/inf, 2 for
invalid arguments. Without ``--log-dir`` the events and ETTR files go to a
temporary folder that is removed at the end (kept when the run fails).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lm_resiliency.errors import ConfigError
from lm_resiliency.faults import ARM_ENV, FaultSchedule
from lm_resiliency.models.hf import INSTALL_HINT, transformers_available

PROG = "python -m mtgs.trainer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's options (shared by ``lm-resiliency train`` and ``mtgs.trainer``)."""
    parser.add_argument(
        "--mode",
        choices=("baseline", "mtgs"),
        default="mtgs",
        help="baseline: plain DDP; mtgs: step transactions (default)",
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument(
        "--model",
        choices=("gpt", "distilbert"),
        default="gpt",
        help="gpt: tiny GPT (default); distilbert: random DistilBERT (needs .[hf])",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="vocabulary size (default 256 for gpt, 30522 for distilbert)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer blocks (gpt: 2, distilbert: 6)"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="embedding width (gpt: 128, distilbert: 768, a multiple of its 12 heads)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mtgs-force-abort-step",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="every rank votes to abort STEP once (repeatable)",
    )
    parser.add_argument(
        "--mtgs-disable-hook",
        action="store_true",
        help="vote with an explicit all-reduce instead of inside the gradient one",
    )
    parser.add_argument(
        "--mtgs-disable-shadow",
        action="store_true",
        help="no in-memory shadow: a failed update cannot be rolled back",
    )
    parser.add_argument(
        "--mtgs-disable-2pc",
        action="store_true",
        help="no commit confirmation after optimizer.step()",
    )
    parser.add_argument(
        "--mtgs-trace",
        action="store_true",
        help="write each rank's MTGS phases as Chrome trace JSON (trace-rank<R>.json in "
        "--log-dir; Perfetto opens it)",
    )
    parser.add_argument(
        "--mtgs-max-retries",
        type=int,
        default=2,
        metavar="N",
        help="retries of an aborted step before the run fails (default 2)",
    )
    parser.add_argument(
        "--faults",
        default="",
        metavar="SPEC",
        help="inject faults, e.g. 'nan_grad@1:3,sigkill@0:4' (KIND@RANK:STEP[*])",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the ranks' events, ETTR and results here (default: a temporary folder, "
        "removed at the end unless the run fails)",
    )
    parser.add_argument(
        "--pg-timeout-s",
        type=float,
        default=30.0,
        help="process-group timeout: bound on every collective (default 30)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def register(subparsers: Any) -> None:
    """Add the ``train`` subcommand to the ``lm-resiliency`` parser."""
    parser = subparsers.add_parser(
        "train",
        help="run a short multi-rank training with MTGS step transactions",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(func=run, prog="lm-resiliency train")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mtgs.trainer``."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(prog=PROG)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Validate, launch the ranks, print the summary; returns the exit code."""
    prog = getattr(args, "prog", PROG)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(settings["log_dir"])
    temporary = args.log_dir is None
    run_file = log_dir / "run.json"
    run_file.write_text(json.dumps(settings))
    print(
        f"[train] mode={args.mode} model={args.model} ranks={args.nproc} steps={args.steps} "
        f"logs={log_dir}" + (" (temporary)" if temporary else ""),
        flush=True,
    )
    code = 1
    try:
        launched_ok = _launch(settings, run_file)
        results = _results(log_dir, args.nproc)
        code = _summarize(args, results, launched_ok, log_dir, temporary=temporary)
    finally:
        if temporary and code == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
    return code


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    distilbert = args.model == "distilbert"
    if args.layers is None:
        args.layers = 6 if distilbert else 2
    if args.width is None:
        args.width = 768 if distilbert else 128
    for name in ("steps", "nproc", "batch_size", "seq_len", "layers", "width", "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.mtgs_max_retries < 0:
        raise ConfigError(f"--mtgs-max-retries={args.mtgs_max_retries} must be >= 0")
    mtgs_flags = bool(
        args.mtgs_force_abort_step
        or args.mtgs_disable_hook
        or args.mtgs_disable_shadow
        or args.mtgs_disable_2pc
        or args.mtgs_trace
    )
    if args.mode == "baseline" and mtgs_flags:
        raise ConfigError("the --mtgs-* options need --mode mtgs (baseline has no transactions)")
    for s in args.mtgs_force_abort_step:
        if not 1 <= s <= args.steps:
            raise ConfigError(
                f"--mtgs-force-abort-step={s} is outside the run's steps 1..{args.steps}"
            )
    schedule = FaultSchedule.parse(args.faults)
    for f in schedule:
        if f.rank >= args.nproc:
            raise ConfigError(f"fault {f.spec()} names rank {f.rank} but --nproc={args.nproc}")
        if f.step > args.steps:
            raise ConfigError(
                f"fault {f.spec()} is at step {f.step}, outside the run's steps 1..{args.steps}; "
                f"use a step <= --steps={args.steps} (or raise --steps)"
            )
    if distilbert and not transformers_available():
        raise ConfigError(INSTALL_HINT)
    if distilbert and args.width % 12:
        raise ConfigError(
            f"--width={args.width} is not a multiple of DistilBERT's 12 attention heads; "
            "use e.g. --width 96 (or the default 768)"
        )
    vocab = args.vocab if args.vocab is not None else (30522 if args.model == "distilbert" else 256)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mtgs-train-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return {
        "mode": args.mode,
        "model": args.model,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "vocab": vocab,
        "layers": args.layers,
        "width": args.width,
        "lr": args.lr,
        "seed": args.seed,
        "max_retries": args.mtgs_max_retries,
        "force_abort_steps": sorted(set(args.mtgs_force_abort_step)),
        "disable_hook": args.mtgs_disable_hook,
        "disable_shadow": args.mtgs_disable_shadow,
        "disable_2pc": args.mtgs_disable_2pc,
        "trace": args.mtgs_trace,
        "faults": schedule.spec(),
        "log_dir": str(log_dir),
        "pg_timeout_s": args.pg_timeout_s,
        "threads": args.threads,
        "nproc": args.nproc,
    }


def _launch(settings: dict[str, Any], run_file: Path) -> bool:
    """Run the workers under torchrun's elastic agent; ``False`` if any worker failed."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", str(settings["threads"]))
    if settings["faults"]:
        os.environ[ARM_ENV] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(settings["nproc"]),
        run_id=f"mtgs-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the agent binds a free port itself
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)(
            "-m", "lm_resiliency.cli._train_worker", str(run_file)
        )
    except ChildFailedError:
        return False
    return True


def _results(log_dir: Path, nproc: int) -> dict[int, dict[str, Any]]:
    out = {}
    for rank in range(nproc):
        path = log_dir / f"result-rank{rank}.json"
        if path.exists():
            out[rank] = json.loads(path.read_text())
    return out


def _summarize(
    args: argparse.Namespace,
    results: dict[int, dict[str, Any]],
    launched_ok: bool,
    log_dir: Path,
    *,
    temporary: bool = False,
) -> int:
    failed = {r: res["error"] for r, res in results.items() if "error" in res}
    missing = [r for r in range(args.nproc) if r not in results]
    not_finite = {
        r: next(i for i, x in enumerate(res["losses"], 1) if not math.isfinite(x))
        for r, res in results.items()
        if "error" not in res and not all(math.isfinite(x) for x in res.get("losses", []))
    }
    if failed or missing or not launched_ok or not_finite:
        for rank, error in sorted(failed.items()):
            print(f"[train] rank {rank} failed: {error}", file=sys.stderr)
        for rank in missing:
            print(f"[train] rank {rank} died without a result (killed?)", file=sys.stderr)
        for rank, step in sorted(not_finite.items()):
            why = " (baseline has no transaction to catch it)" if args.mode == "baseline" else ""
            print(
                f"[train] rank {rank}: the loss is not finite from step {step} on{why}",
                file=sys.stderr,
            )
        print(f"[train] FAILED; events and ETTR kept in {log_dir}", file=sys.stderr)
        return 1
    r0 = results[0]
    ettr_ms = [ns / 1e6 for ns in r0["ettr_ns"]]
    ettr = (
        f"median={statistics.median(ettr_ms):.3f} ms max={max(ettr_ms):.3f} ms (n={len(ettr_ms)})"
        if ettr_ms
        else "n/a (no recovery)"
    )
    loss = r0["losses"][-1] if r0["losses"] else float("nan")
    # A local repair (no 2PC: one rank redoes its update from its shadow) happens on one
    # rank only, so it is counted over every rank; its ETTR is that rank's.
    repairs = {r: int(res.get("local_repairs", 0)) for r, res in sorted(results.items())}
    where = ", ".join(f"rank {r}: {n}" for r, n in repairs.items() if n)
    print(
        f"[train] committed steps={args.steps} aborts={r0.get('aborts', 0)} "
        f"retries={r0.get('retries', 0)} rollbacks={r0.get('rollbacks', 0)} "
        f"local_repairs={sum(repairs.values())}" + (f" ({where})" if where else "")
    )
    print(f"[train] ETTR {ettr}")
    print(
        "[train]   (ETTR: effective time to recovery, from detecting a bad step to ready to retry)"
    )
    print(
        f"[train] tokens/s={r0['tokens_per_s']:.0f} (all ranks, first step excluded) "
        f"final loss={loss:.4f}"
    )
    if temporary:
        print(
            "[train] OK (events and ETTR removed with the temporary folder; --log-dir keeps them)"
        )
    else:
        print(f"[train] OK; events and ETTR in {log_dir}")
    return 0

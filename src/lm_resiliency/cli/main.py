"""Entry point of the ``lm-resiliency`` command.

Each subcommand lives in its own module under ``lm_resiliency.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (returning the
exit code). Modules are imported lazily by name so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules, in the order ``--help`` lists them.
_COMMANDS = (
    "demo",
    "chunk_size",
    "inspect",
    "clean",
    "train",
    "launch",
    "coordinator",
    "bench",
)
# Subcommands that parse their own command line, because they pass part of it through
# untouched (``launch``: torchrun's arguments and the training command after ``--``).
_PASSTHROUGH = ("launch",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm-resiliency",
        description="Fast failure recovery for distributed PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"lm_resiliency.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        module = importlib.import_module(f"lm_resiliency.cli.{argv[0]}")
        return int(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

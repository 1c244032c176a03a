"""The healthy-path benchmark: baseline, GEMINI, SCOUT and GEMINI+SCOUT+MTGS, with thresholds.

The same command as ``lm-resiliency bench`` (``lm_resiliency/cli/bench.py`` says what
is measured; the thresholds, ratios only, are ``lm_resiliency/cli/bench_thresholds.json``).
Exits 1 naming each crossed threshold.

Usage: python benchmarks/healthy_path.py [--quick] [--models demo larger] [--rounds 4]
       [--steps 40] [--interval 10] [--results bench-results.jsonl] [--plot steps.png]
"""

from __future__ import annotations

import sys

from lm_resiliency.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

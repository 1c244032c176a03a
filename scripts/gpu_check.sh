#!/usr/bin/env bash
# GPU-only checks (CUDA capture path, pinned arenas, MTGS shadow on CUDA); CI never runs this.
# Uses the machine's own torch; crc32c is only needed by persistence, which this does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 scripts/gpu_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"

#!/usr/bin/env bash
# GPU-only checks (CUDA capture path, pinned arenas, SCOUT replays, MTGS shadow and
# transactions on CUDA, live membership on NCCL);
# CI never runs this. Uses the machine's own torch; crc32c and xxhash come from .whl/ (below).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# crc32c and xxhash are not in the device image: carry their wheels in .whl/ (see
# docs/capture.md).
if ls .whl/crc32c-*.whl .whl/xxhash-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/crc32c-*.whl .whl/xxhash-*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 scripts/gpu_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
rc=${PIPESTATUS[0]}
# The memory tier on a GPU host: NCCL default group, cudaHostRegister per GiB, a
# restarted process re-attaching and re-registering (~1 min).
python3 scripts/gpu_memory_check.py 2>&1 | tee -a "${OUT:-/tmp}/gpu_check.log"
rc=$(( rc || PIPESTATUS[0] ))
# SCOUT on the GPU: replays reproducible and agreeing across two DDP ranks (fp32, bf16
# autocast), training RNG untouched, a persistent SDC found, the replay's floor (~1 min).
python3 scripts/gpu_scout_check.py 2>&1 | tee -a "${OUT:-/tmp}/gpu_check.log"
rc=$(( rc || PIPESTATUS[0] ))
# Live membership on NCCL: a replica SIGKILLed inside a 16 MiB bucket all-reduce; the
# survivors leave within 1 s, abort, rebuild (ncclCommShrink and a new group, both timed),
# all-reduce correctly on the next epoch and exit cleanly (2-4 replicas, one GPU each where
# there are enough, else shared with per-process NCCL_HOSTID; ~1 min).
python3 scripts/gpu_live_check.py 2>&1 | tee -a "${OUT:-/tmp}/gpu_check.log"
rc=$(( rc || PIPESTATUS[0] ))
# The test suite's CUDA-only tests (skipped on CPU machines).
python3 -m pytest -q -p no:cacheprovider -k "cuda" \
  tests/unit/test_mtgs_shadow.py tests/unit/test_mtgs_pieces_local.py tests/distributed/test_mtgs_transactions.py \
  tests/distributed/test_mtgs_pieces.py 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_check.log"
rc=$(( rc || PIPESTATUS[0] ))
# Optional: the recovery benchmark on the device host's many idle cores, where the
# owner's page mapping and the checksums can overlap Gloo's threads (on the 2-core
# CI machines they cannot). Takes ~3 min; GPU_CHECK_RECOVERY=1 to run it.
if [ "${GPU_CHECK_RECOVERY:-0}" = 1 ]; then
  python3 benchmarks/recovery.py --skip-demo --repeats 3 2>&1 | tee -a "${OUT:-/tmp}/gpu_check.log"
fi
# Optional: the framework adapters on CUDA (DeepSpeed ZeRO-1/2/3 bf16, Megatron Core,
# TorchTitan with 2+ GPUs; NCCL, one rank per GPU up to 2; ~2-3 min). Needs deepspeed /
# megatron-core / torchtitan on the host (no registry there: carry their wheels in .whl/ as
# for crc32c; a framework that is missing is skipped). GPU_CHECK_FRAMEWORKS=1.
if [ "${GPU_CHECK_FRAMEWORKS:-0}" = 1 ]; then
  if ls .whl/deepspeed-*.whl .whl/megatron_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/site \
      .whl/deepspeed-*.whl .whl/megatron_core-*.whl 2>&1 | tail -2
  fi
  python3 scripts/gpu_frameworks.py 2>&1 | tee -a "${OUT:-/tmp}/gpu_check.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit $rc

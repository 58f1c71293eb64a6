#!/usr/bin/env bash
# On the GPU machine: prefix caching and KV offloading, measured on a random-weight Qwen3-0.6B
# shape (chapter 04). First the offloading tests on CUDA (pinned CPU tier, Triton backend),
# then one engine per mode, each in its own process; a table at the end, JSON in $OUT.
# EAGER="" runs with CUDA graphs (decode steps); the default is --enforce-eager.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MINIVLLM_TEST_DEVICE=cuda timeout 60 python -m pytest tests/test_kv_offload.py -q -x -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest_kv_offload_cuda.txt"
BENCH="python -m minivllm.bench.prefix_caching ${EAGER---enforce-eager} --repeats ${REPEATS:-4} --requests-per-prefix ${PER_PREFIX:-40}"
for mode in on off offload; do
  timeout 80 $BENCH --mode $mode --json "$OUT/prefix_caching_$mode.json" > "$OUT/log_$mode.txt" 2>&1 || tail -5 "$OUT/log_$mode.txt"
done
python -m minivllm.bench.prefix_caching --summarize "$OUT"/prefix_caching_*.json | tee "$OUT/summary.txt"

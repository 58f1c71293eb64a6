#!/usr/bin/env bash
# On the GPU machine: kernel tests in bf16, parity with the Triton backend, kernel benchmarks,
# and the end-to-end throughput with the Triton vs the torch attention backend.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python -m pytest tests/test_kernels.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest_kernels_cuda.txt"
MINIVLLM_TEST_DEVICE=cuda timeout 200 python -m pytest tests/test_hf_parity.py -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest_parity_cuda.txt"
timeout 240 python -m minivllm.bench.kernels --json "$OUT/kernels.json" 2>&1 | grep -v Warning | tail -12
timeout 200 python scripts/gpu/sweep_prefill.py 2>&1 | grep -v Warning | tail -16
if [ "${SKIP_THROUGHPUT:-0}" = 1 ]; then exit 0; fi
timeout 200 python -m minivllm.bench.throughput --shape qwen3-0.6b --num-requests 256 --attention-backend triton --json "$OUT/throughput_triton.json" 2>&1 | grep -E "tokens_per_s|seconds|steps"
timeout 200 python -m minivllm.bench.throughput --shape qwen3-0.6b --num-requests 256 --attention-backend torch --json "$OUT/throughput_torch.json" 2>&1 | grep -E "tokens_per_s|seconds|steps"

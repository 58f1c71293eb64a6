#!/usr/bin/env bash
# On the GPU machine: the engine core in-process vs in its own process (chapter 02), modes
# alternated so that drift on the machine does not favour one. Needs pyzmq + msgspec (.whl/).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/pyzmq-*.whl .whl/msgspec-*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import zmq, msgspec" || exit 1
git rev-parse HEAD 2>/dev/null > "$OUT/commit.txt"
for mode in inproc mp mp inproc; do
    timeout 150 python -m minivllm.bench.client_modes --mode $mode --workload nano --json "$OUT/client_modes.jsonl" 2>&1 | grep '^{'
done
for mode in inproc mp inproc mp; do
    timeout 60 python -m minivllm.bench.client_modes --mode $mode --workload short --json "$OUT/client_modes.jsonl" 2>&1 | grep '^{'
done
# The CPU comparison on this host's cores: the demo model's shape and tokenizer, text in and out.
for mode in inproc mp inproc mp; do
    OMP_NUM_THREADS=4 timeout 90 python -m minivllm.bench.client_modes --mode $mode --workload text --device cpu \
        --model .gpu_carry/demo_shape --num-prompts 32 --max-tokens 32 --json "$OUT/client_modes.jsonl" 2>&1 | grep '^{'
done

#!/usr/bin/env bash
# On the GPU machine: `minivllm serve` on a random-weight Qwen3-0.6B shape, `minivllm bench serve`
# against it at a few request rates, then the same prompts offline through LLM.generate.
# Needs the py3.12 wheels of the serve extra in .whl/ (carry: [".whl"]).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python -m pip install -q --no-index --find-links .whl fastapi 'uvicorn[standard]' prometheus-client aiohttp pyzmq msgspec > "$OUT/pip.txt" 2>&1; then
  tail -20 "$OUT/pip.txt"; echo "the serve extra did not install: see pip.txt"; exit 1
fi
MODEL=$(python -c "from minivllm.bench.shapes import write_shape_folder as w; print(w('qwen3-0.6b', '/tmp/qwen3-0.6b-shape'))")
ENGINE="--load-format dummy --skip-tokenizer-init --max-model-len 2048 ${EXTRA_ENGINE:-}"
WORKLOAD="--num-prompts ${NUM_PROMPTS:-200} --random-input-len 256 --random-output-len ${OUTPUT_LEN:-128}"
CLIENT="--num-workers ${BENCH_WORKERS:-1}"  # load-generator processes
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

python -m minivllm.cli.main serve "$MODEL" --port 8011 --served-model-name qwen3-0.6b $ENGINE ${EXTRA_SERVE:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 0.5; done
# CPU seconds (user + system) the API server process has used so far: its cost per token.
api_cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$SERVER/stat"; }
# With --api-server-count the launcher only waits: CPU seconds of each of its children instead
# (the engine core, the API processes, multiprocessing's resource tracker).
children_cpu() {
  for pid in $(cat /proc/$SERVER/task/$SERVER/children 2>/dev/null); do
    awk -v hz="$(getconf CLK_TCK)" -v pid=$pid '{printf "%s:%.2f ", pid, ($14 + $15) / hz}' "/proc/$pid/stat"
  done; echo
}
for rate in ${RATES:-16 64 inf}; do
  before=$(api_cpu)
  echo "children_cpu_s before: $(children_cpu)"
  curl -s http://127.0.0.1:8011/metrics | grep -E "^minivllm:engine_(steps|busy)" | sed 's/^/before /'
  timeout 120 python -m minivllm.bench.serve --base-url http://127.0.0.1:8011 $WORKLOAD $CLIENT --request-rate "$rate" \
    --result-file "$OUT/serve_rate_$rate.json" 2>&1 | grep -E "throughput|_ttft_|_tpot_|completed|failed|client_cpu|warning"
  curl -s http://127.0.0.1:8011/metrics | grep -E "^minivllm:engine_(steps|busy)" | sed 's/^/after /'
  echo "children_cpu_s after: $(children_cpu)"
  echo "api_process_cpu_s $(python -c "print(round($(api_cpu) - $before, 2))") (rate $rate)"
done
curl -s http://127.0.0.1:8011/metrics | grep -E "^minivllm:(num_preemptions|kv_cache|prompt_tokens|generation_tokens)" >> "$OUT/gpu.txt"
kill "$SERVER"; wait "$SERVER" 2>/dev/null

[ "${OFFLINE:-1}" = 1 ] && timeout 150 python -m minivllm.bench.serve --backend offline --model "$MODEL" $ENGINE $WORKLOAD \
  --result-file "$OUT/offline.json" 2>&1 | grep -E "throughput|completed"

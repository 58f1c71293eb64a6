#!/usr/bin/env bash
# The API server process's CPU time per streamed token (chapter 11), on the CPU, no GPU needed.
#
#   bash scripts/api_cpu_per_token.sh          # N=256 streams of 64 tokens; PORT=8015
#
# A tiny random Qwen3-shaped model (hidden 64, 2 layers, a 32,000-token vocabulary) keeps the
# engine core's steps cheap, so the API process's share shows. `minivllm serve` runs it; after a
# warm-up, `minivllm bench serve` sends N requests at once; the API process's utime + stime
# (from /proc, which leaves the engine core's own process out) before and after give its CPU
# seconds, and the load generator's are timed with /usr/bin/time. The figure depends on how many
# tokens merge into one event, i.e. on the core's speed too: compare runs on one machine only.
set -euo pipefail
export OMP_NUM_THREADS=1
N=${N:-256}; PORT=${PORT:-8015}
MODEL=$(mktemp -d)
cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
 "head_dim": 32, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
 "tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false, "bos_token_id": 1, "eos_token_id": 2}
JSON
ENGINE="--load-format dummy --skip-tokenizer-init --max-model-len 1024 --device cpu --dtype float32"
minivllm serve "$MODEL" --port "$PORT" --served-model-name tiny $ENGINE > "$MODEL/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$MODEL"' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
ticks() { awk '{print $14 + $15}' "/proc/$SERVER/stat"; }
minivllm bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 16 --random-input-len 16 --random-output-len 8 > /dev/null
before=$(ticks)
/usr/bin/time -f "load generator: %U s user, %S s system" minivllm bench serve --base-url "http://127.0.0.1:$PORT" \
  --num-prompts "$N" --random-input-len 64 --random-output-len 64 --request-rate inf \
  --result-file "$MODEL/result.json" 2>&1 | grep -E "output_throughput|output_events|load generator"
after=$(ticks)
python3 -c "
import json
events = json.load(open('$MODEL/result.json'))['output_events']
seconds, tokens = ($after - $before) / $(getconf CLK_TCK), $N * 64
print(f'API process: {seconds:.2f} CPU-s for {tokens} tokens in {events} events: '
      f'{seconds / tokens * 1e6:.0f} us per token, {seconds / events * 1e6:.0f} us per event')"

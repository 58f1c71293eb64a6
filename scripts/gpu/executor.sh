#!/usr/bin/env bash
# On the GPU machine (chapter 05): CUDA graphs / torch.compile correctness, then, side by side in
# one run, offline throughput (minivllm with CUDA graphs, eager, and HF transformers) with the
# copy-bandwidth bound, and the decode step time (eager vs CUDA graphs) against the weights-read
# floor, for the Qwen3-0.6B and Llama-3.2-1B shapes. Results: $OUT/executor-h200.json, log: $OUT/log.txt.
#   MINIVLLM_COMMIT=$(git rev-parse --short HEAD) PARTS="tests qwen llama latq latl parity" scripts/gpu/executor.sh
# Other parts: qwen-graphs llama-graphs qwen-eager async profile profile-async profile-llama
# kprofile (the kernels of a replay) sweep-decode (the decode kernel at batch 256) kernel-tests
# sweep-skinny (the skinny GEMM vs cuBLAS for 1-8 token batches) skinny (batch 1-4 steps with
# and without it) decode-variants (head_dim-64 decode configurations in the engine) gc-freeze
# (throughput with and without the frozen start-up heap) profile-nano (the step profile of the
# throughput benchmark's own workload) run-profile (the GPU's busy time and kernels over a whole
# throughput run, both shapes, async) heads-fastest (throughput with the decode kernel's two
# launch orders, both shapes, async) sampler (throughput with the one-pass sampling kernel and
# with the PyTorch sampler, both shapes, async) sampler-tests sweep-sampler (the kernel's launch
# settings against the PyTorch sampler, 1-256 rows) llama-async sweep-gemm (cuBLAS on the decode
# steps' products at batch 16-256 against read and math floors)
# pdl (batch 1-4 steps with programmatic dependent launch, the in-kernel decode merge and the
# RoPE-written cache each turned off) pdl-throughput (throughput with and without all three)
# chain (a dependent kernel's cost in a graph; a pre-norm product with and without its norm)
# tile (batch 1-4 steps with the 1-2 token skinny tile and without) async-both
# profile-eager (where an eager step's ~15 ms of host time goes) piecewise (a prefill step
# with piecewise graphs against eager: step profile and latency, both graph modes) split (the
# decode kernel's shortest split: a graph of decode calls, and Qwen3-0.6B steps per setting)
# persistent (chapter 06's persistent kernels, then batch 1/4 steps of both shapes, async)
# inputs (one copy a step and the greedy argmax kernel against OLD_TREE, an earlier commit's
# minivllm/: the greedy sampler sweep, batch 1/4 steps interleaved, the step's GPU timeline;
# inputs-latency and inputs-timeline run those two on their own, ROUNDS times for the first)
# inputs-host (the host's time per batch-1 step by part, the code and OLD_TREE). skinny-few
# (batch 1/2/4 steps with the skinny GEMM on every 1- or 2-token product, gate_up included).
# rope-bound (batch 1/4 steps with no RoPE kernel, timing only: what fusing it away could save).
# removal-bounds (batch 1/4 steps as it is, with every layer's weights in L2, and with RoPE, attention,
# the norms and all three taken out, timing only: each operator's share of the step). trees-latency (batch 1/4 steps of
# each tree in TREES, "name=path name=path", interleaved ROUNDS times: a clean before/after).
# norm-in-product (batch 1/2/4 steps with the add + RMSNorm before qkv and gate_up inside those
# products at one token, and with the norm kernel, interleaved ROUNDS times). norm-lean (the
# same, with a third variant: the norm weight loaded where it is used, fewer registers).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/res
PARTS=${PARTS:-"tests qwen llama latq latl parity"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
LOG="$OUT/log.txt"
merge() {  # every result so far into one JSON (the run may be cut short by its time limit)
  python3 - <<'EOF'
import glob, json, os
results = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/res/*.json"))}
json.dump(results, open(os.environ["OUT"] + "/executor-h200.json", "w"), indent=1)
EOF
}
bench() {  # name, then the arguments of `minivllm bench ...`
  local name=$1; shift
  echo "== $name: minivllm bench $*" | tee -a "$LOG"
  # VARIANT (scripts/gpu/engine_variants.py): the bench with one engine variant patched in.
  # -P: `python -m` would put the working directory first on sys.path, ahead of PYTHONPATH, and
  # an OLD_TREE given through PYTHONPATH would silently be the code as it is. Which tree ran is logged.
  if [ -n "${VARIANT:-}" ]; then local runner="scripts/gpu/engine_variants.py $VARIANT --"; else local runner="-P -m minivllm.cli.main"; fi
  python3 -P -c "import minivllm, os; print('   minivllm from', os.path.dirname(os.path.dirname(minivllm.__file__)))" | tee -a "$LOG"
  timeout 300 python3 $runner bench "$@" --json "/tmp/res/$name.json" >>"$LOG" 2>&1 || echo "!! $name failed ($?)" | tee -a "$LOG"
  python3 -c "import json; r=json.load(open('/tmp/res/$name.json')); print({k: r.get(k) for k in ('output_tokens_per_s', 'bound_output_tokens_per_s', 'fraction_of_bound', 'seconds', 'engine_steps', 'kernel_compiles_during_run')} if 'points' not in r else [(p['batch_size'], round(p['decode_step_ms'], 3), round(p.get('graph_replay_ms', 0), 3), round(p.get('floor_ms', 0), 3)) for p in r['points']])" 2>/dev/null | tee -a "$LOG"
  merge
}
# OLD_TREE: an earlier commit's minivllm/ (`git archive COMMIT minivllm | tar -x -C .old`), run
# beside the code as it is.
trees_latency() {  # batch 1/4 steps, async, of each tree in TREES ("name=path ..."), interleaved ROUNDS times
  for round in $(seq ${ROUNDS:-1}); do
    for shape in $1; do
      for tree in $TREES; do
        PYTHONPATH=${tree#*=}:/tmp/site bench "latency-$shape-${tree%%=*}-$round" latency --shape $shape --batch-sizes 1,4 --num-iters 5 --async-scheduling
      done
    done
  done
}
inputs_latency() {  # OLD_TREE before the code as it is
  TREES="before=$OLD_TREE after=$PWD" ROUNDS=${ROUNDS:-2} trees_latency "${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}"
}
inputs_timeline() {  # where the GPU's time outside the replay goes, after and before
  timeout 200 python3 scripts/gpu/step_timeline.py --shape qwen3-0.6b --batch 1 --json "$OUT/timeline-after.json" 2>&1 | tail -16 | tee -a "$LOG"
  PYTHONPATH=$OLD_TREE:/tmp/site timeout 200 python3 scripts/gpu/step_timeline.py --shape qwen3-0.6b --batch 1 --json "$OUT/timeline-before.json" 2>&1 | tail -16 | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
for part in $PARTS; do
  case $part in
    tests)
      timeout 400 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider -x 2>&1 | tail -15 | tee -a "$LOG" ;;
    qwen)
      bench throughput-qwen3-graphs throughput --shape qwen3-0.6b
      bench throughput-qwen3-hf throughput --shape qwen3-0.6b --hf --no-bound ;;
    qwen-graphs)  # without the HF baseline (it takes minutes and does not change with minivllm)
      bench throughput-qwen3-graphs throughput --shape qwen3-0.6b ;;
    llama-graphs)
      bench throughput-llama-graphs throughput --shape llama-3.2-1b ;;
    async)  # async scheduling: the nano-vllm workload and batch-1/256 decode steps, both shapes
      bench throughput-qwen3-async throughput --shape qwen3-0.6b --async-scheduling
      bench throughput-llama-async throughput --shape llama-3.2-1b --async-scheduling
      bench latency-qwen3-0.6b-async latency --shape qwen3-0.6b --batch-sizes 1,256 --output-len 64 --num-iters 3 --async-scheduling ;;
    profile-async)
      for b in 256 1; do
        timeout 120 python3 scripts/gpu/step_profile.py --workload decode --batch $b --tokens 64 --caching off --top 12 --async-scheduling 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      done ;;
    profile-nano)  # where the throughput benchmark's own steps spend their time, both shapes, async
      for shape in ${PROFILE_NANO_SHAPES:-llama-3.2-1b qwen3-0.6b}; do
        timeout 150 python3 scripts/gpu/step_profile.py --shape $shape --workload nano --top 20 --async-scheduling 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      done ;;
    profile-llama)  # the Llama shape's decode step at batch 256, async, and its latency ladder
      timeout 120 python3 scripts/gpu/step_profile.py --shape llama-3.2-1b --workload decode --batch 256 --tokens 64 --caching off --top 12 --async-scheduling 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      bench latency-llama-3.2-1b-async latency --shape llama-3.2-1b --batch-sizes 1,64,256 --output-len 64 --num-iters 3 --async-scheduling ;;
    sweep-decode)  # the decode kernel's settings at the throughput benchmark's batch-256 shapes
      timeout 150 python3 scripts/gpu/sweep_decode_shapes.py --json "$OUT/decode-shapes.json" 2>&1 | grep -v Warn | tee -a "$LOG" ;;
    skinny)  # batch 1-4 decode steps with the skinny GEMM (default) and with cuBLAS only, both shapes
      for shape in qwen3-0.6b llama-3.2-1b; do
        for v in default cublas; do
          VARIANT=$v bench "latency-$shape-$v" latency --shape $shape --batch-sizes 1,2,4 --output-len 64 --num-iters 3 --async-scheduling
        done
      done ;;
    gc-freeze)  # offline throughput with the start-up heap frozen (default) and not, both shapes, async
      for shape in llama-3.2-1b qwen3-0.6b; do
        for v in default nofreeze; do
          VARIANT=$v bench "throughput-$shape-async-$v" throughput --shape $shape --async-scheduling
        done
      done ;;
    run-profile)
      for shape in ${RUN_PROFILE_SHAPES:-llama-3.2-1b qwen3-0.6b}; do
        timeout 200 python3 scripts/gpu/run_profile.py --shape $shape --async-scheduling --json "$OUT/run-profile-$shape.json" 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      done ;;
    heads-fastest)
      for shape in llama-3.2-1b qwen3-0.6b; do
        for v in heads-fastest=0 heads-fastest=1; do
          VARIANT=$v bench "throughput-$shape-async-$v" throughput --shape $shape --async-scheduling
        done
      done ;;
    sampler)
      for shape in llama-3.2-1b qwen3-0.6b; do
        for v in default torch-sampler; do
          VARIANT=$v bench "throughput-$shape-async-$v" throughput --shape $shape --async-scheduling
        done
      done ;;
    sweep-gemm)  # cuBLAS on the decode steps' matrix products at batch 16-256, against their floors
      timeout 200 python3 scripts/gpu/sweep_decode_gemm.py --json "$OUT/decode-gemm.json" 2>&1 | grep -v Warn | tee -a "$LOG" ;;
    llama-async)  # the Llama shape's offline throughput, async, alone
      bench throughput-llama-3.2-1b-async throughput --shape llama-3.2-1b --async-scheduling ;;
    sweep-sampler)  # the one-pass sampling kernel's launch settings against the PyTorch sampler
      timeout 200 python3 scripts/gpu/sweep_sampler.py --json "$OUT/sampler-sweep.json" 2>&1 | grep -v Warn | tee -a "$LOG" ;;
    sampler-tests)
      timeout 300 python3 -m pytest tests/test_kernels.py tests/test_sampler.py tests/test_executor.py -q -p no:cacheprovider -x 2>&1 | tail -4 | tee -a "$LOG" ;;
    decode-variants)  # head_dim-64 decode configurations in the whole engine (Llama, offline, async)
      for v in default decode=128,8,3 decode=64,4,3; do
        VARIANT=$v bench "throughput-llama-async-$v" throughput --shape llama-3.2-1b --async-scheduling
      done ;;
    sweep-skinny)  # the skinny GEMM against cuBLAS at batch 1-8 decode shapes
      timeout 400 python3 scripts/gpu/sweep_skinny_gemm.py --json "$OUT/skinny-gemm.json" 2>&1 | grep -v Warn | tee -a "$LOG" ;;
    pdl)  # batch 1-4 decode steps with PDL and the two fusions, each turned off, both shapes (PDL_VARIANTS)
      for shape in ${PDL_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
        for v in ${PDL_VARIANTS:-default nopdl merge-kernel unfused-kv before-pdl}; do
          VARIANT=$v bench "latency-$shape-$v" latency --shape $shape --batch-sizes ${PDL_BATCHES:-1,4} --output-len 64 --num-iters 3 --async-scheduling
        done
      done ;;
    pdl-throughput)  # offline throughput, async, default vs the kernels before PDL and the fusions (PDL_SHAPES)
      for rep in 1 2; do
        for shape in ${PDL_SHAPES:-llama-3.2-1b qwen3-0.6b}; do
          for v in default before-pdl; do
            VARIANT=$v bench "throughput-$shape-async-$v-$rep" throughput --shape $shape --async-scheduling
          done
        done
      done ;;
    chain)  # what one kernel costs in a chain of dependent kernels; a pre-norm product with and without its norm
      timeout 240 python3 scripts/gpu/chain_latency.py --json "$OUT/chain-latency.json" 2>&1 | tee -a "$LOG" ;;
    tile)  # batch 1-4 decode steps with the 1-2 token skinny tile (default) and with the 3-8 token one (TILE_SHAPES)
      for shape in ${TILE_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
        for v in default skinny-tile=4,512,4,2; do
          VARIANT=$v bench "latency-$shape-$v" latency --shape $shape --batch-sizes 1,2,4 --output-len 64 --num-iters 3 --async-scheduling
        done
      done ;;
    split)  # the decode kernel's splits: a graph of decode calls, then batch 1-4 steps per variant (SPLIT_VARIANTS, SPLIT_SHAPES)
      timeout 240 python3 scripts/gpu/decode_split_latency.py --json "$OUT/decode-split.json" 2>&1 | tail -30 | tee -a "$LOG"
      for v in ${SPLIT_VARIANTS:-default min-split=2+whole-context=1}; do
        for shape in ${SPLIT_SHAPES:-qwen3-0.6b}; do
          VARIANT=$v bench "latency-$shape-$v" latency --shape $shape --batch-sizes 1,2,4 --output-len 64 --num-iters 3 --async-scheduling
        done
      done ;;
    persistent)  # chapter 06's persistent kernels: the chain of products, the whole layers; then batch 1/4 steps, both shapes
      timeout 240 python3 scripts/gpu/persistent_chain.py --only "separate,atomic BN=8 warps=8 prefetch=1,slice" \
        --json "$OUT/persistent-chain.json" 2>&1 | grep -v "^{'name'" | tail -12 | tee -a "$LOG"
      timeout 240 python3 scripts/gpu/persistent_decode.py --json "$OUT/persistent-decode.json" 2>&1 \
        | grep -v "^{'name'" | tail -8 | tee -a "$LOG"
      for shape in qwen3-0.6b llama-3.2-1b; do
        bench "latency-$shape-async" latency --shape $shape --batch-sizes 1,4 --num-iters 5 --async-scheduling
      done ;;
    inputs)  # a step's inputs in one copy, greedy batches by the kernel's argmax, against OLD_TREE:
      # the greedy sampler sweep, then the two parts below
      timeout 200 python3 scripts/gpu/sweep_sampler.py --greedy --json "$OUT/greedy-sampler.json" 2>&1 | tail -10 | tee -a "$LOG"
      inputs_latency
      inputs_timeline ;;
    inputs-latency)
      inputs_latency ;;
    rope-bound)  # batch 1/4 steps without the RoPE kernel (timing only: engine_variants.py no-rope)
      for shape in ${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
        VARIANT=no-rope bench "latency-$shape-no-rope" latency --shape $shape --batch-sizes 1,4 --num-iters 5 --async-scheduling
      done ;;
    removal-bounds)  # batch 1/4 steps with one operator (or three) taken out (timing only: engine_variants.py)
      for shape in ${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
        # shared-weights: every layer on layer 0's weights, resident in L2 (Qwen3's 31.5 MB layer fits,
        # Llama's 122 MB does not): the layers with no weight from DRAM.
        for v in default shared-weights no-attention no-rope no-norm no-rope+no-attention+no-norm shared-weights+no-attention; do
          VARIANT=$v bench "latency-$shape-$v" latency --shape $shape --batch-sizes 1,4 --num-iters 5 --async-scheduling
        done
      done ;;
    norm-in-product)  # batch 1/2/4 steps with the pre-norms inside qkv and gate_up (one token) and without, interleaved
      for round in $(seq ${ROUNDS:-1}); do
        for shape in ${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
          for v in norm-in-product=0 norm-in-product=1; do
            VARIANT=$v bench "latency-$shape-$v-$round" latency --shape $shape --batch-sizes 1,2,4 --num-iters 5 --async-scheduling
          done
        done
      done ;;
    norm-lean)  # the norm inside every one-token product, its weight loaded ahead and at use, and the norm kernel
      for round in $(seq ${ROUNDS:-1}); do
        for shape in ${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
          for v in norm-in-product=0 norm-in-product=1 norm-in-product=1+norm-weight-at-use; do
            VARIANT=$v bench "latency-$shape-$v-$round" latency --shape $shape --batch-sizes 1,2,4 --num-iters 5 --async-scheduling
          done
        done
      done ;;
    trees-latency)  # batch 1/4 steps of each tree in TREES, interleaved (each logs where minivllm came from)
      trees_latency "${INPUT_SHAPES:-qwen3-0.6b}" ;;
    skinny-few)  # batch 1-4 steps with the skinny GEMM on every product of 1 or 2 tokens (gate_up too), and as it is
      for round in $(seq ${ROUNDS:-1}); do
        for shape in ${INPUT_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
          for v in default skinny-few=1 skinny-few=2; do
            VARIANT=$v bench "latency-$shape-$v-$round" latency --shape $shape --batch-sizes 1,2,4 --num-iters 5 --async-scheduling
          done
        done
      done ;;
    inputs-timeline)
      inputs_timeline ;;
    inputs-host)  # the host's time per batch-1 step, by part, after and before
      timeout 200 python3 scripts/gpu/step_profile.py --workload decode --batch 1 --tokens 256 --caching off --async-scheduling --top 12 2>&1 | grep -v INFO | head -30 | tee -a "$LOG"
      PYTHONPATH=$OLD_TREE:/tmp/site timeout 200 python3 scripts/gpu/step_profile.py --workload decode --batch 1 --tokens 256 --caching off --async-scheduling --top 12 2>&1 | grep -v INFO | head -30 | tee -a "$LOG" ;;
    async-both)  # offline throughput, async, both shapes, the code as it is
      for shape in qwen3-0.6b llama-3.2-1b; do
        bench "throughput-$shape-async" throughput --shape $shape --async-scheduling
      done ;;
    kernel-tests)
      timeout 150 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider -x 2>&1 | tail -4 | tee -a "$LOG" ;;
    kprofile)  # the GPU kernels of a decode graph replay, both shapes (KPROFILE_SHAPES), batch 1 and 256
      for shape in ${KPROFILE_SHAPES:-qwen3-0.6b llama-3.2-1b}; do
        timeout 180 python3 scripts/gpu/kernel_profile.py --shape $shape --batch 1 --batch 256 --json "$OUT/kernels-$shape.json" 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      done ;;
    piecewise)  # prefill steps as piecewise graphs vs eager (cudagraph_mode full_decode_only)
      for mode in full_and_piecewise full_decode_only; do
        timeout 150 python3 scripts/gpu/step_profile.py --workload one-prompt --caching off --top 12 --cudagraph-mode $mode 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
        bench "latency-qwen3-0.6b-$mode" latency --shape qwen3-0.6b --batch-sizes 1,16,64 --output-len 16 --num-iters 3 --async-scheduling --cudagraph-mode $mode
      done ;;
    profile-eager)  # an eager step (one 128-token prompt): the host's launches, by function
      timeout 150 python3 scripts/gpu/step_profile.py --workload one-prompt --caching off --top 30 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG" ;;
    profile)  # where a decode step's time goes, at batch 256 and 1
      for b in 256 1; do
        timeout 120 python3 scripts/gpu/step_profile.py --workload decode --batch $b --tokens 64 --caching off --top 12 2>&1 | grep -v "\[transformers\]" | tee -a "$LOG"
      done ;;
    qwen-eager)
      bench throughput-qwen3-eager throughput --shape qwen3-0.6b --enforce-eager --no-bound ;;
    llama)
      bench throughput-llama-graphs throughput --shape llama-3.2-1b
      bench throughput-llama-hf throughput --shape llama-3.2-1b --hf --no-bound ;;
    latq|latl)
      shape=$([ $part = latq ] && echo qwen3-0.6b || echo llama-3.2-1b)
      bench "latency-$shape-graphs" latency --shape $shape --batch-sizes 1,4,16,64,256 --output-len 64 --num-iters 3
      bench "latency-$shape-eager" latency --shape $shape --batch-sizes 1,4,16,64,256 --output-len 64 --num-iters 3 --enforce-eager ;;
    parity)
      MINIVLLM_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_hf_parity.py -q -p no:cacheprovider 2>&1 | tail -6 | tee -a "$LOG" ;;
  esac
done

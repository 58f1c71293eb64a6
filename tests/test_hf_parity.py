"""minivllm's models against HF transformers: greedy tokens equal, logprobs close.

Tiny random-weight Llama, Mistral, Qwen2 and Qwen3 models (several layers, GQA, awkward
sizes) generate for several prompts of different lengths in one batch. The same run is then
repeated under stress settings that force chunked prefill (a token budget smaller than the
prompts) and preemption (too few KV blocks for all requests) with a small block size: the
outputs must not change.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, GreedyRun, check_logprobs_close, hf_greedy, make_tiny_model
from minivllm import LLM, SamplingParams

MAX_TOKENS = 32
NUM_LOGPROBS = 5
PROMPT_LENGTHS = [1, 7, 16, 33, 58]
# Matching tokens' logprobs: both sides compute in float32; the difference is accumulation
# order (HF attends over the whole sequence at once, minivllm over paged blocks), measured
# at ~1e-6. 1e-4 leaves room for that, and a real bug moves logprobs by far more.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory):
    arch = request.param
    folder = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
    vocab = TINY_CONFIGS[arch]["vocab_size"]
    rng = random.Random(1234)
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    return arch, folder, prompts, hf_greedy(folder, prompts, MAX_TOKENS, NUM_LOGPROBS)


def run_minivllm(folder, prompts, **engine_args) -> tuple[list[GreedyRun], LLM]:
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = []
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "length", f"expected to run to max_tokens, got {completion.finish_reason}"
        top = [{tid: lp.logprob for tid, lp in pos.items() if lp.rank <= NUM_LOGPROBS} for pos in completion.logprobs]
        runs.append(GreedyRun(completion.token_ids, top))
    return runs, llm


def assert_matches_hf(hf_runs: list[GreedyRun], runs: list[GreedyRun]) -> None:
    exact = check_logprobs_close(hf_runs, runs)
    assert exact == len(hf_runs), f"only {exact}/{len(hf_runs)} prompts matched HF token for token"
    for i, (a, b) in enumerate(zip(hf_runs, runs)):
        for pos, (ta, tb) in enumerate(zip(a.top_logprobs, b.top_logprobs)):
            for tid in ta.keys() & tb.keys():
                assert abs(ta[tid] - tb[tid]) < LOGPROB_ATOL, (
                    f"prompt {i} position {pos} token {tid}: HF logprob {ta[tid]:.6f}, minivllm {tb[tid]:.6f}"
                )


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_greedy_matches_hf(tiny_model, attention_backend):
    arch, folder, prompts, hf_runs = tiny_model
    runs, _ = run_minivllm(folder, prompts, block_size=16, num_gpu_blocks_override=256, attention_backend=attention_backend)
    assert_matches_hf(hf_runs, runs)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_chunked_prefill_and_preemption_do_not_change_outputs(tiny_model, attention_backend):
    arch, folder, prompts, hf_runs = tiny_model
    # 16 tokens per step splits every prompt longer than that across steps; 40 blocks of 4
    # tokens cannot hold all five requests at full length (they need 9+10+12+17+23 = 71).
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", block_size=4,
              num_gpu_blocks_override=40, max_num_batched_tokens=16, max_model_len=160, attention_backend=attention_backend)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS, detokenize=False)
    # Drive the engine by hand (what LLM.generate does) to watch for a partial prefill.
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished, partial_prefills = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        partial_prefills += sum(
            1 for r in engine.engine_core.scheduler.running if r.num_computed_tokens < r.num_prompt_tokens
        )
    outputs = [finished[str(i)] for i in range(len(prompts))]
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0, "the stress setting was meant to force preemption"
    assert partial_prefills > 0, "the stress setting was meant to force chunked prefill"
    runs = [
        GreedyRun(o.outputs[0].token_ids,
                  [{t: lp.logprob for t, lp in pos.items() if lp.rank <= NUM_LOGPROBS} for pos in o.outputs[0].logprobs])
        for o in outputs
    ]
    assert_matches_hf(hf_runs, runs)
    assert core.scheduler.kv_cache_manager.num_free_blocks == 40, "every block must be free once all requests finished"


def test_every_layer_shares_one_rope_table(tiny_model):
    # The cos/sin table depends only on the config; a copy per layer would cost num_layers - 1
    # tables of GPU memory (0.53 GiB for Qwen3-0.6B) and change no output.
    import transformers

    from minivllm.models.registry import ModelRegistry

    arch, folder, _, _ = tiny_model
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = ModelRegistry.resolve_model_cls(config.architectures)(config)
    tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1, f"{arch}: {len(tables)} RoPE tables for {len(model.model.layers)} layers"
    buffers = [name for name, _ in model.named_buffers() if name.endswith("cos_sin_cache")]
    assert len(buffers) == 1, f"{arch}: the model holds {len(buffers)} cos/sin buffers"

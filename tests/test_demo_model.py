"""The embedded demo model (SmolLM2-135M-Instruct) against HF transformers on the same weights.

minivllm converts the demo's GGUF once into an HF folder; transformers loads that folder too,
so both run the very same float32 weights. Greedy answers to chat prompts must be equal.
"""

from __future__ import annotations

import torch

from minivllm import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
MAX_TOKENS = 32


@torch.inference_mode()
def test_demo_greedy_answers_equal_transformers(demo_llm, demo_model_dir):
    import transformers

    tokenizer = demo_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = demo_llm.chat(conversations, params, use_tqdm=False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([out.prompt_token_ids])
        # An explicit attention mask: the chat prompt contains <|im_end|>, which is also the pad
        # token, and generate() would otherwise mask those prompt tokens out as padding.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, (
            f"{prompt!r}: minivllm {tokenizer.decode(out.outputs[0].token_ids)!r} != HF {tokenizer.decode(ref)!r}"
        )


def test_chat_template_is_applied_once(demo_llm):
    tokenizer = demo_llm.get_tokenizer()
    out = demo_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    text = tokenizer.decode(out.prompt_token_ids)
    assert text.count("<|im_start|>user") == 1 and text.rstrip().endswith("<|im_start|>assistant"), text


def test_minivllm_run_reports_its_prefix_cache_hits(capsys):
    # Two identical chat prompts: the second finds the first one's full blocks in the cache
    # (entered when they are scheduled, so even within the same step).
    import re

    from minivllm.cli.main import main

    assert main(["run", "--prompt", "Name a colour.", "--prompt", "Name a colour.", "--max-tokens", "3"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.search(r"prefix cache hits (\d+)/(\d+) prompt tokens", summary)
    assert match, summary
    hits, queries = int(match[1]), int(match[2])
    assert 0 < hits < queries, summary

"""Outside references for the parity tests: tiny random HF models and transformers' greedy runs.

`check_logprobs_close` follows the rule of vLLM's test helper of the same name: two runs agree
on a sequence if their tokens are equal, or, at the first position where they differ, each
run's token is among the other's top logprobs (a near-tie resolved differently by rounding);
after that position the sequences are not compared further.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class GreedyRun:
    token_ids: list[int]
    top_logprobs: list[dict[int, float]]  # per position: token id -> logprob, top-k


TINY_CONFIGS = {
    # Awkward sizes on purpose: head counts and widths that are not powers of two, GQA.
    "llama": dict(
        cls="LlamaConfig", vocab_size=503, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": dict(
        cls="MistralConfig", vocab_size=411, hidden_size=64, intermediate_size=136, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024, sliding_window=256,
    ),
    "qwen2": dict(
        cls="Qwen2Config", vocab_size=389, hidden_size=72, intermediate_size=152, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        cls="Qwen3Config", vocab_size=467, hidden_size=80, intermediate_size=168, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    ),
}


def make_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    import transformers

    spec = dict(TINY_CONFIGS[arch])
    config = getattr(transformers, spec.pop("cls"))(
        # A wider init than the default 0.02 makes the next-token distribution peaked enough
        # that greedy choices are not decided by rounding noise.
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=None, **spec
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, num_logprobs: int) -> list[GreedyRun]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
        token_ids = out.sequences[0, len(prompt):].tolist()
        top = []
        for logits in out.logits:
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            values, ids = logprobs.topk(num_logprobs)
            top.append(dict(zip(ids.tolist(), values.tolist())))
        runs.append(GreedyRun(token_ids, top))
    return runs


def check_logprobs_close(ref: list[GreedyRun], test: list[GreedyRun], ref_name: str = "hf", test_name: str = "minivllm") -> int:
    """Assert vLLM's rule; return how many sequences matched token for token."""
    exact = 0
    for i, (a, b) in enumerate(zip(ref, test, strict=True)):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta == tb:
                continue
            assert ta in b.top_logprobs[pos] and tb in a.top_logprobs[pos], (
                f"prompt {i}, position {pos}: {ref_name} chose {ta}, {test_name} chose {tb}, and neither "
                f"is in the other's top logprobs ({ref_name}: {a.top_logprobs[pos]}, {test_name}: {b.top_logprobs[pos]})"
            )
            break
        else:
            exact += 1
    return exact

"""Qwen2 and Qwen3: the Llama decoder with two small changes (chapter 06).

Qwen2 adds a bias to the q/k/v projections. Qwen3 drops that bias and instead normalizes each
head of q and k with an RMSNorm before RoPE, which keeps attention logits in range.
"""

from __future__ import annotations

from minivllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

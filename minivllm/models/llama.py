"""Llama-family decoder, built from minivllm's own layers (chapter 06).

One file serves Llama (1/2/3.x), Mistral, Qwen2 and Qwen3: they differ only in a bias on the
q/k/v projections (Qwen2) and a per-head RMSNorm on q and k before RoPE (Qwen3); see
`models/qwen.py`. The forward pass takes the flattened batch (`input_ids`, `positions`, both
[num_tokens]) and returns hidden states; `compute_logits` is applied only to the rows that
need sampling. `packed_modules_mapping` tells the loader which checkpoint tensors are fused
into one of our layers, and into which shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.distributed.parallel_state import get_tp_size
from minivllm.models.layers.activation import SiluAndMul
from minivllm.models.layers.attention import Attention
from minivllm.models.layers.custom_ops import skinny_gemm_applies
from minivllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.models.layers.norm import RMSNorm, rms_norm_linear
from minivllm.models.layers.rotary import RotaryEmbedding, rope_parameters


def build_rotary_embedding(config: Any) -> RotaryEmbedding:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta, scaling = rope_parameters(config)
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)


# --8<-- [start:llama-attention]
class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = rotary_emb  # one module, and one cos/sin table, shared by every layer
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the qkv product (the decoder layer runs that product with its norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        # On CUDA the RoPE kernel can also write this step's K/V into the cache (one kernel less).
        cache = self.attn.fused_kv_write(q)
        kv_write = (v.view(-1, self.num_kv_heads, self.head_dim), *cache) if cache is not None else None
        if self.qk_norm:  # Qwen3: RMSNorm each head before RoPE (one fused kernel on CUDA)
            q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm, kv_write=kv_write)
        else:
            q, k = self.rotary_emb(positions, q, k, kv_write=kv_write)
        return self.o_proj(self.attn(q, k, v, kv_written=kv_write is not None))
# --8<-- [end:llama-attention]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul and the down product (the decoder layer runs gate_up with its norm)."""
        # A few tokens on CUDA: the down product's skinny kernel does SiLU-and-mul itself.
        down_input = gate_up[..., : self.down_proj.weight.shape[1]]  # the shape the product sees
        if skinny_gemm_applies(down_input, self.down_proj.weight):
            return self.down_proj(gate_up, gated_input=True)
        return self.down_proj(self.act_fn(gate_up))


# --8<-- [start:llama-decoder-layer]
class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm, x + f(norm(x)) twice; each residual add and norm goes with the product after
        # it (one kernel for a few tokens on CUDA, the fused add + RMSNorm and the product otherwise).
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden_states, residual)
        hidden_states = self.self_attn.attend(positions, qkv)
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up), residual
# --8<-- [end:llama-decoder-layer]


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # The cos/sin of every position depend only on the config: one table (21 MB for
        # Qwen3-0.6B's 40,960 positions in float32) serves all layers, as vLLM's get_rope shares it.
        rotary_emb = build_rotary_embedding(config)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, qkv_bias, qk_norm, rotary_emb) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter's name fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias or getattr(config, "attention_bias", False), self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

"""The torch reference attention backend: PagedAttention in plain PyTorch.

It is written to be read, not to be fast. New K/V are first written into the paged cache at
their slots (`reshape_and_cache`); then each request's queries attend to its whole context,
gathered from the cache through its block table. Decode requests (one query each) are handled
together in one padded call; prefills and prompt chunks one request at a time, with a causal
mask shifted by the context already in the cache. Works for any block size, GQA, and a batch
that mixes new prompts, continued chunks and decodes. Chapter 04 (PagedAttention) and
chapter 06 (attention backends) explain it; the Triton backend must match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata


# --8<-- [start:reshape-and-cache]
# exercise[ch04-reshape-and-cache]: view kv_cache[0] and [1] as [num_slots, kv_heads, head_dim]; write key/value at the rows slot_mapping
def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping.

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; viewed as
    [2, num_slots, ...], slot s is block s // block_size, offset s % block_size.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value
# --8<-- [end:reshape-and-cache]


# --8<-- [start:gather-kv]
# exercise[ch04-gather-kv]: the first cdiv(seq_len, block_size) blocks of block_ids, from the cache; flatten; keep seq_len rows
def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len tokens of K and V of one request: [seq_len, num_kv_heads, head_dim].

    `block_ids` is the request's block table (a row of `block_tables`, which may be padded
    past the blocks the request holds); token t is at offset t % block_size of block
    block_ids[t // block_size].
    """
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_ids[:num_blocks].long()
    key = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    value = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return key, value
# --8<-- [end:gather-kv]


class TorchAttentionBackend:
    name = "torch"

    # --8<-- [start:torch-attention-forward]
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        output: torch.Tensor | None = None,  # where to write; rows past num_actual_tokens untouched
    ) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        if key is not None:  # None: this step's K/V are in the cache already (a piecewise graph wrote them)
            self.write_kv(key[:num_tokens], value[:num_tokens], kv_cache, meta.slot_mapping)
        if output is None:
            output = torch.empty_like(query)
        if meta.num_decodes > 0:
            output[: meta.num_decodes] = self._decode(query[: meta.num_decodes], kv_cache, meta, scale)
        for i in range(meta.num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            output[start:end] = self._prefill(query[start:end], kv_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale)
        return output
    # --8<-- [end:torch-attention-forward]

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        reshape_and_cache(key, value, kv_cache, slot_mapping)

    # --8<-- [start:torch-prefill]
    # exercise[ch04-prefill-attention]: gather_kv the context; query j is at position seq_len - query_len + j, sees keys <= it; SDPA, enable_gqa
    @staticmethod
    def _prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        """One request's query_len new tokens attend to its seq_len tokens of context.

        query is [query_len, num_heads, head_dim]: the request's last query_len tokens, whose
        K/V are already in the cache. The context is read through `block_ids`. With GQA,
        num_heads is a multiple of num_kv_heads. Returns [query_len, num_heads, head_dim].
        """
        key, value = gather_kv(kv_cache, block_ids, seq_len)
        query_len = query.shape[0]
        # Query token j sits at position seq_len - query_len + j and sees keys up to there.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [query_len, seq_len]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        return out.transpose(0, 1)
    # --8<-- [end:torch-prefill]

    # --8<-- [start:torch-decode]
    # exercise[ch04-decode-attention]: gather all decode requests' blocks at once, pad to the longest, mask keys >= seq_len; one SDPA, enable_gqa
    @staticmethod
    def _decode(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """All decode requests at once: gather each context, pad to the longest, mask the pad.

        query is [n, num_heads, head_dim], one token for each of the first n =
        meta.num_decodes requests. Request i attends to its meta.seq_lens[i] tokens, read
        through meta.block_tables[i]. Returns [n, num_heads, head_dim].
        """
        n = meta.num_decodes
        block_size = kv_cache.shape[2]
        seq_lens = meta.seq_lens[:n]
        max_len = max(meta.seq_lens_cpu[:n])
        blocks = meta.block_tables[:n, : -(-max_len // block_size)].long()  # [n, nb]
        key = kv_cache[0, blocks].flatten(1, 2)[:, :max_len]  # [n, max_len, kv_heads, dim]
        value = kv_cache[1, blocks].flatten(1, 2)[:, :max_len]
        mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [n, max_len]
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],  # [n, heads, 1, dim]
            key.transpose(1, 2), value.transpose(1, 2),  # [n, kv_heads, max_len, dim]
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )
        return out[:, :, 0, :]
    # --8<-- [end:torch-decode]


# --8<-- [start:get-attention-backend]
def get_attention_backend(name: str, device: torch.device):
    """The backend object for `attention_backend`; a clear error when it cannot run here."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        import os

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA device; on the CPU it runs only under "
                "Triton's interpreter (set TRITON_INTERPRET=1 before starting). Use 'torch' here."
            )
        from minivllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")
# --8<-- [end:get-attention-backend]

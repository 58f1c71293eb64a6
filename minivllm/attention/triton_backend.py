"""The Triton attention backend: the same contract as the torch backend, with real kernels.

Writes the step's K/V into the paged cache with `reshape_and_cache`, then runs the decode
requests (one query token each, placed first by the model runner) through the split-K paged
decode kernel and everything else (new prompts, continued chunks) through the varlen paged
prefill kernel. The default on CUDA; on the CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the tests check it there. Chapter 06.
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        from minivllm import kernels  # defines the kernels: TRITON_INTERPRET must be set by now on CPU

        self.kernels = kernels

    # --8<-- [start:triton-attention-forward]
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        call = self.kernels.call_kernel
        n = meta.num_actual_tokens
        call("reshape_and_cache", key[:n], value[:n], kv_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        d = meta.num_decodes  # decode requests come first, one token each
        if d > 0:
            output[:d] = call(
                "paged_decode_attention", query[:d], kv_cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                max_seq_len=max(meta.seq_lens_cpu[:d]),
            )
        if d < meta.num_reqs:
            query_lens = [meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i] for i in range(d, meta.num_reqs)]
            output[d:n] = call(
                "paged_prefill_attention", query[d:n], kv_cache, meta.block_tables[d:], meta.seq_lens[d:],
                meta.query_start_loc[d:] - d, scale, query_lens_cpu=query_lens,
            )
        return output
    # --8<-- [end:triton-attention-forward]

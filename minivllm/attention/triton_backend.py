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
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = self.kernels.call_kernel
        n = meta.num_actual_tokens
        if key is not None:  # None: this step's K/V are in the cache already (a piecewise graph wrote them)
            self.write_kv(key[:n], value[:n], kv_cache, meta.slot_mapping)
        if output is None:  # contiguous, as the caller needs; piecewise graphs pass a fixed buffer
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        d = meta.num_decodes  # decode requests come first, one token each
        if d > 0:  # written straight into the output's first rows (no copy kernel)
            call(
                "paged_decode_attention", query[:d], kv_cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                max_seq_len=self._longest_decode(meta), out=output[:d],
            )
        if d < meta.num_reqs:
            if "prefill_tiles" not in meta.backend_cache:  # the same for every layer of this step
                query_lens = [meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i] for i in range(d, meta.num_reqs)]
                block_m = self.kernels.prefill_block_m(query.shape[1], kv_cache.shape[3])
                meta.backend_cache["prefill_tiles"] = self.kernels.prefill_tiles(
                    query_lens, meta.seq_lens_cpu[d:], block_m, query.device
                )
                meta.backend_cache["prefill_query_start_loc"] = meta.query_start_loc[d:] - d
                # Slices after the decodes, made 16-byte aligned once for every layer (chapter 06:
                # an unaligned pointer would be another kernel variant to compile).
                meta.backend_cache["prefill_block_tables"] = self.kernels.aligned(meta.block_tables[d:])
                meta.backend_cache["prefill_seq_lens"] = self.kernels.aligned(meta.seq_lens[d:])
            cache = meta.backend_cache
            call(
                "paged_prefill_attention", query[d:n], kv_cache, cache["prefill_block_tables"], cache["prefill_seq_lens"],
                cache["prefill_query_start_loc"], scale, tiles=cache["prefill_tiles"], out=output[d:n],
            )
        return output
    # --8<-- [end:triton-attention-forward]

    @staticmethod
    def _longest_decode(meta: AttentionMetadata) -> int:
        if "decode_max_seq_len" not in meta.backend_cache:  # the same for every layer of this step
            meta.backend_cache["decode_max_seq_len"] = max(meta.seq_lens_cpu[: meta.num_decodes])
        return meta.backend_cache["decode_max_seq_len"]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new K/V into the paged cache; slots of -1 are skipped."""
        self.kernels.call_kernel("reshape_and_cache", key, value, kv_cache, slot_mapping)

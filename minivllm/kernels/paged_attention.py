"""PagedAttention in Triton: decode (split-K, GQA-aware) and varlen prefill over the paged cache.

Both kernels read K and V straight out of the paged cache through each request's block table:
for context token n, `block_id = block_table[n // block_size]` and its K row sits at slot
`block_id * block_size + n % block_size`. So any block size works, and the tile of tokens a
program processes (BLOCK_N) is independent of the cache's block size.

**Decode** (one query token per request). One program per (request, KV head, split) loads the
query rows of all query heads that share that KV head (GQA: the group is read once, used G
times), walks its share of the context with an online softmax, and writes an unnormalized
partial result; the last split of the (request, KV head) to finish merges them (flash-decoding).
Splitting the context keeps the GPU busy when there are few requests with long contexts; each
context's split length follows its own length, so a short one needs one split, nothing to
merge, and its program writes the output itself.

**Prefill** (new prompts, continued chunks). One program per (tile of BLOCK_M query tokens of
one request, KV head) packs the G query heads of that KV head into its rows and attends to the
request's context up to each query's position (causal, shifted by the tokens already cached),
FlashAttention-2 style: whole tiles below the diagonal without a mask, then the diagonal.

Chapter 06 explains the tiling and the online softmax. The references below compute the same
thing as the torch backend, in the plainest float32 PyTorch: gather, repeat heads, softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import aligned, next_power_of_2, pdl_enabled, pdl_launch_options


# -- references --------------------------------------------------------------------------------


def paged_decode_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim] → out [num_seqs, num_heads, head_dim]."""
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        out[i] = _attend(query[i : i + 1], kv_cache, block_tables[i], int(seq_lens[i]), scale)[0]
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], requests laid end to end → out, same shape."""
    out = torch.empty_like(query)
    for i in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        out[start:end] = _attend(query[start:end], kv_cache, block_tables[i], int(seq_lens[i]), scale)
    return out


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """The simplest correct paged attention for one request, in float32."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=query.device)
    slots = block_ids.long()[positions // block_size] * block_size + positions % block_size
    key = kv_cache[0].flatten(0, 1)[slots].float()  # [seq_len, kv_heads, dim]
    value = kv_cache[1].flatten(0, 1)[slots].float()
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    query_pos = torch.arange(seq_len - query.shape[0], seq_len, device=query.device)
    scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value).to(query.dtype)


# -- decode --------------------------------------------------------------------------------------


# --8<-- [start:decode-tile]
# exercise[ch06-decode-online-softmax]: s = dot(q, trans(k)) * scale, -inf where not n_mask; m_new = max(m_i, row max of s); acc, l_i times exp2(m_i - m_new), plus p = exp2(s - m_new)
@triton.jit
def _decode_tile(acc, m_i, l_i, q, k, v, n_mask, scale, DOT_PRECISION: tl.constexpr):
    """Fold one tile of BLOCK_N context tokens into the running softmax of the G query rows.

    q is [BLOCK_G, BLOCK_D] (the query heads that share this KV head; padding rows are 0);
    k and v are [BLOCK_N, BLOCK_D], the tile's keys and values; n_mask [BLOCK_N] is False for
    tokens past the end of the split, whose k and v were loaded as 0: they must get no weight.
    At least one token of a tile is valid. The running state, per query row: m_i [BLOCK_G],
    the largest score so far; l_i [BLOCK_G], the sum of exp2(score - m_i) so far; acc
    [BLOCK_G, BLOCK_D] float32, the sum of exp2(score - m_i) * v so far (not divided by l_i).
    Scores are in base 2: `scale` is head_dim**-0.5 * log2(e), so exp2(q·k * scale) equals
    exp(q·k * head_dim**-0.5). Use `tl.dot(..., input_precision=DOT_PRECISION)` for both
    products, with the probabilities cast to v's dtype. Returns the new (acc, m_i, l_i).
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # how much the old max overestimated: shrink the old sums
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
# --8<-- [end:decode-tile]


# --8<-- [start:decode-kv-tile]
@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, offs_n, limit, kv_head, cache_stride_kv, cache_stride_slot,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, offs_d, d_mask):
    """K and V [BLOCK_N, BLOCK_D] of context tokens offs_n through the block table; 0 from `limit` on."""
    n_mask = offs_n < limit
    block_id = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    slots = block_id.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    kv_offs = slots[:, None] * cache_stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(cache_ptr + cache_stride_kv + kv_offs, mask=kv_mask, other=0.0)
    return k, v
# --8<-- [end:decode-kv-tile]


# --8<-- [start:decode-partial-kernel]
# num_splits and min_split change from step to step; left unspecialized, they never cause a
# recompile (Triton would otherwise compile a variant for 1 and for multiples of 16).
@triton.jit(do_not_specialize=["num_splits", "min_split", "whole_len"])
def _decode_partial_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, mid_out_ptr, mid_ml_ptr,
    scale, q_stride_seq, q_stride_head, cache_stride_kv, cache_stride_slot, bt_stride, num_splits, min_split, whole_len,
    out_ptr, out_stride_seq, out_stride_head, counters_ptr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_SPLIT: tl.constexpr, HEADS_FASTEST: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, BLOCK_S: tl.constexpr,
    EARLY_LOADS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL and not EARLY_LOADS:  # (to measure what the loads before the wait save)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if HEADS_FASTEST:  # the KV heads of one sequence are neighbours in launch order (see the launcher)
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # This context's split length, from its own length: its share of the launch's splits in
    # whole tiles, never shorter than min_split tokens; a context of at most whole_len tokens
    # stays in one split (a few tiles in a row cost less than a merge). The launch is sized for
    # the longest context of the batch (in a CUDA graph, max_model_len), so a short context
    # uses only the first few splits and the later ones are empty.
    split_size = tl.maximum(min_split, tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N)
    split_size = tl.where(seq_len <= whole_len, whole_len, split_size)
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)
    num_active = tl.cdiv(seq_len, split_size)  # the splits that hold a token of this context
    if MERGE_IN_KERNEL:
        if split >= num_active:
            return  # nothing to attend to, and the merge does not wait for this split

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    bt_row = block_tables_ptr + seq * bt_stride
    # The query token is the context's last, `newest`: the kernels just before this one write
    # its K/V this very step. Every older token was written in an earlier step, so this split's
    # first tile of them is loaded before the wait, while the previous kernel still runs; the
    # newest token's K/V is loaded after the wait and put into its place in that tile.
    newest = seq_len - 1
    offs_n = start + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(cache_ptr, bt_row, offs_n, tl.minimum(end, newest), kv_head, cache_stride_kv,
                         cache_stride_slot, HEAD_DIM, BLOCK_SIZE, offs_d, d_mask)
    newest_block = tl.load(bt_row + newest // BLOCK_SIZE).to(tl.int64)
    newest_offs = (newest_block * BLOCK_SIZE + newest % BLOCK_SIZE) * cache_stride_slot + kv_head * HEAD_DIM + offs_d
    if USE_PDL and EARLY_LOADS:  # programmatic dependent launch: q and the newest K/V come from the previous kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if start < end:  # (a split past the end of its context, launched for a longer one, holds no token)
        is_newest = (offs_n == newest)[:, None]
        k = tl.where(is_newest, tl.load(cache_ptr + newest_offs, mask=d_mask, other=0.0)[None, :], k)
        v = tl.where(is_newest, tl.load(cache_ptr + cache_stride_kv + newest_offs, mask=d_mask, other=0.0)[None, :], v)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q, k, v, offs_n < end, scale, DOT_PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):  # the rest of the split, after the wait: all written
        k, v = _load_kv_tile(cache_ptr, bt_row, n0 + tl.arange(0, BLOCK_N), end, kv_head, cache_stride_kv,
                             cache_stride_slot, HEAD_DIM, BLOCK_SIZE, offs_d, d_mask)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q, k, v, n0 + tl.arange(0, BLOCK_N) < end, scale, DOT_PRECISION)

    out_ptrs = out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + offs_d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:  # the whole context in this program: normalize and write the output, no merge
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    if MERGE_IN_KERNEL:
        if num_active == 1:  # a short context, in this split alone: the same
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
            return
    # Partial results of this split: unnormalized acc, and (max, sum) for the merge.
    row = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(mid_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_ml_ptr + row * 2, m_i, mask=g_mask)
    tl.store(mid_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
    if MERGE_IN_KERNEL:
        # The last split to finish merges them all: every program of this (sequence, KV
        # head) adds one to a counter once its partials are written (the barrier orders all
        # of the program's stores before the atomic, which releases them to the GPU); the one
        # that sees num_active - 1 knows every other partial is written, resets the counter
        # for the next launch and merges. No program ever waits for another, and the merge
        # sums the splits in a fixed order, so the result does not depend on which one is last.
        tl.debug_barrier()
        counter = counters_ptr + seq * (NUM_HEADS // GROUP) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_active - 1:
            tl.atomic_xchg(counter, 0)
            for g in tl.static_range(GROUP):
                first_row = (seq * NUM_HEADS + kv_head * GROUP + g) * num_splits
                _merge_splits(mid_out_ptr, mid_ml_ptr, first_row, num_active,
                              out_ptr + seq * out_stride_seq + (kv_head * GROUP + g) * out_stride_head,
                              HEAD_DIM, BLOCK_D, BLOCK_S, ".cg")  # .cg: read the partials from L2, never a stale L1 line
# --8<-- [end:decode-partial-kernel]


# --8<-- [start:decode-merge-kernel]
@triton.jit
def _merge_splits(mid_out_ptr, mid_ml_ptr, first_row, num_rows, out_ptr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Combine the partial results of one (sequence, head): rows first_row ... + num_rows - 1."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_rows
    row = first_row + offs_s
    m = tl.load(mid_ml_ptr + row * 2, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(mid_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0, cache_modifier=CACHE)
    acc = tl.load(mid_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0, cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    # An empty split has m = -inf and contributes exp(-inf) = 0.
    weight = tl.where(s_mask & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_out_ptr, mid_ml_ptr, out_ptr, out_stride_seq, out_stride_head, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, NUM_HEADS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _merge_splits(mid_out_ptr, mid_ml_ptr, (seq * NUM_HEADS + head) * num_splits, num_splits,
                  out_ptr + seq * out_stride_seq + head * out_stride_head, HEAD_DIM, BLOCK_D, BLOCK_S, "")
# --8<-- [end:decode-merge-kernel]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would silently use tf32 on the GPU; "ieee" keeps fp32 exact.
    return "ieee" if dtype == torch.float32 else "tf32"


LOG2_E = 1.4426950408889634


# --8<-- [start:decode-launcher]
def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    max_seq_len: int | None = None, num_splits: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None, programs_per_sm: int = 4,
    out: torch.Tensor | None = None, heads_fastest: bool | None = None, merge_in_kernel: bool | None = None,
    min_split_tiles: int | None = None, whole_context_tiles: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; written into `out`
    ([num_seqs, num_heads, head_dim], unit stride in the last dim) when given, else a new tensor.

    With one split (many sequences: enough programs already), the partial kernel normalizes
    and writes the output itself. With several, the last split of each (sequence, KV head) to
    finish merges them in the same kernel (`merge_in_kernel`, the default); a context that
    fits in one split skips the merge. With merge_in_kernel=False a second kernel merges.
    `num_splits` is the launch's; each context's splits are its own length over num_splits,
    in whole tiles and at least `min_split_tiles` tiles (default DECODE_MIN_SPLIT_TILES), and
    a context of at most `whole_context_tiles` tiles (default DECODE_WHOLE_CONTEXT_TILES) is
    not split at all.
    """
    num_seqs, num_heads, head_dim = query.shape
    default_block_n, default_warps, default_stages = decode_config(head_dim)
    block_n, num_warps, num_stages = block_n or default_block_n, num_warps or default_warps, num_stages or default_stages
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    # Both at least one tile, so the kernel's split length is never 0 (a one-tile context fits any split anyway).
    min_split = max(1, DECODE_MIN_SPLIT_TILES if min_split_tiles is None else min_split_tiles) * block_n
    whole_len = max(1, DECODE_WHOLE_CONTEXT_TILES if whole_context_tiles is None else whole_context_tiles) * block_n
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device, block_n, programs_per_sm)
    # No more splits than the longest context fills (each at least min_split tokens).
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, min_split)))
    if max_seq_len <= whole_len:
        num_splits = 1
    query, block_tables, seq_lens = aligned(query), aligned(block_tables), aligned(seq_lens)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1, "out must be [num_seqs, num_heads, head_dim], unit stride"
    one_split = num_splits == 1
    # With one split the partial buffers are not written: a one-row placeholder stands in.
    rows = 1 if one_split else num_seqs * num_heads * num_splits
    mid_out = torch.empty(rows, head_dim, dtype=torch.float32, device=query.device)
    mid_ml = torch.empty(rows, 2, dtype=torch.float32, device=query.device)
    if heads_fastest is None:
        heads_fastest = DECODE_HEADS_FASTEST
    merge_in_kernel = (DECODE_MERGE_IN_KERNEL if merge_in_kernel is None else merge_in_kernel) and not one_split
    counters = split_counters(query.device, num_seqs * num_kv_heads) if merge_in_kernel else seq_lens
    use_pdl = pdl_enabled(query.device)
    grid = (num_kv_heads, num_seqs, num_splits) if heads_fastest else (num_seqs, num_kv_heads, num_splits)
    _decode_partial_kernel[grid](
        query, kv_cache, block_tables, seq_lens, mid_out, mid_ml,
        scale * LOG2_E, query.stride(0), query.stride(1), kv_cache.stride(0), num_kv_heads * head_dim,
        block_tables.stride(0), num_splits, min_split, whole_len, out, out.stride(0), out.stride(1), counters,
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_HEADS=num_heads, DOT_PRECISION=_dot_precision(query.dtype),
        ONE_SPLIT=one_split, HEADS_FASTEST=heads_fastest, MERGE_IN_KERNEL=merge_in_kernel,
        BLOCK_S=merge_block_s(num_splits) if merge_in_kernel else 16, EARLY_LOADS=DECODE_EARLY_LOADS, USE_PDL=use_pdl,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_options(use_pdl),
    )
    if one_split or merge_in_kernel:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        mid_out, mid_ml, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_S=merge_block_s(num_splits), NUM_HEADS=num_heads,
        USE_PDL=use_pdl, **pdl_launch_options(use_pdl),
    )
    return out
# --8<-- [end:decode-launcher]


DECODE_HEADS_FASTEST = False
# Under PDL, load each split's first tile of older tokens before waiting for the previous
# kernel; False waits first (`late-loads` in scripts/gpu/engine_variants.py; chapter 06).
DECODE_EARLY_LOADS = True
DECODE_MERGE_IN_KERNEL = True
# How a context is split (chapter 06, "How the decode kernel splits a context";
# scripts/gpu/decode_split_latency.py on the H200, docs/data/decode-split-h200-2026-12-04.json):
# a context of at most DECODE_WHOLE_CONTEXT_TILES tiles stays in one program, where walking
# its two or three tiles in a row took 6.0 µs against 7.4-7.8 µs split and merged (Qwen3-0.6B,
# batch 1, 160 tokens), and 11.3 against 17-18 µs at batch 32; a longer one is cut into splits
# of at least DECODE_MIN_SPLIT_TILES tiles (one or two tiles measured within about 2 µs of
# each other either way, near the run-to-run spread).
DECODE_MIN_SPLIT_TILES = 1
DECODE_WHOLE_CONTEXT_TILES = 4

_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), for the in-kernel merge.

    One buffer per device, kept for the process: each launch leaves every counter it used
    back at zero (the merging program resets it), so the next launch, and every replay of
    a CUDA graph that captured this buffer, finds them zero. It is allocated the first time
    (the engine's warm-up, before any capture) and may not grow during a capture.
    """
    buffer = _SPLIT_COUNTERS.get(device)
    if buffer is None or buffer.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the decode kernel needs {count} split counters while a CUDA graph is captured; "
                "allocate them before capturing (a decode call with as many sequences)"
            )
        buffer = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[device] = buffer
    return buffer


def decode_config(head_dim: int) -> tuple[int, int, int]:
    """The decode kernel's default (context tokens per tile, warps, pipeline stages) for a head size.

    From sweeps on the H200: for head_dim 128, 64-token tiles, 4 warps and 3 stages reached
    0.97x the copy bandwidth at batch 64, context 4096 (scripts/gpu/sweep_attention.py); for
    head_dim 64, whose key rows are half as long, 256-token tiles with 4 warps and 4 stages
    were fastest at the throughput benchmark's shapes (scripts/gpu/sweep_decode_shapes.py,
    chapter 06).
    """
    return (256, 4, 4) if head_dim <= 64 else (64, 4, 3)


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int = 64, programs_per_sm: int = 4
) -> int:
    """How many splits the decode kernel's launch has per (sequence, KV head); each context
    then uses as many of them as its own length needs.

    Enough programs to fill every SM a few times over, but splits no shorter than
    DECODE_MIN_SPLIT_TILES tiles: each split costs a partial write and a merge read.
    """
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = triton.cdiv(programs_per_sm * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_seq_len, DECODE_MIN_SPLIT_TILES * block_n)))


def merge_block_s(num_splits: int) -> int:
    """The merge kernel's split tile: a power of two, at least 16, so that few variants exist."""
    return max(16, next_power_of_2(num_splits))


# -- prefill -------------------------------------------------------------------------------------


# --8<-- [start:prefill-inner]
@triton.jit
def _prefill_inner(
    acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, kv_head, lo, hi, cache_stride_kv, cache_stride_slot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over context tokens [lo, hi); MASKED applies causality and the end bound."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = offs_n < hi
        else:  # the caller guarantees whole, in-range tiles
            n_mask = offs_n >= 0
        block_id = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = block_id.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_offs = slots[:, None] * cache_stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + cache_stride_kv + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [ROWS, BLOCK_N], base-2 scaled
        if MASKED:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; guard exp2(-inf - -inf) = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
# --8<-- [end:prefill-inner]


# --8<-- [start:prefill-kernel]
@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seq_ptr, tile_start_ptr, out_ptr,
    qk_scale, q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, cache_stride_kv, cache_stride_slot, bt_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program: BLOCK_M query tokens of one request × the GROUP query heads that share one
    # KV head, packed as BLOCK_M * GROUP_PAD rows, so each K/V tile is loaded once per group.
    kv_head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len  # context already in the cache before this step

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (token < query_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_begin + token)[:, None] * q_stride_tok + head[:, None] * q_stride_head + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = (q * qk_scale).to(q_ptr.dtype.element_ty)
    q_pos = num_cached + token

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    bt_row_ptr = block_tables_ptr + seq * bt_stride
    # Keys before the tile's first query are visible to every row: whole tiles, no mask.
    first_q_pos = num_cached + tile_start
    lo = (first_q_pos // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _prefill_inner(acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, kv_head, 0, lo,
                                   cache_stride_kv, cache_stride_slot, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                   False, DOT_PRECISION)
    # The diagonal: causal mask, and no query of this tile sees past its last position.
    hi = tl.minimum(seq_len, first_q_pos + BLOCK_M)
    acc, m_i, l_i = _prefill_inner(acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, kv_head, lo, hi,
                                   cache_stride_kv, cache_stride_slot, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                   True, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_begin + token)[:, None] * o_stride_tok + head[:, None] * o_stride_head + offs_d[None, :],
             out, mask=row_mask[:, None] & d_mask[None, :])
# --8<-- [end:prefill-kernel]


PREFILL_BLOCK_ROWS = 128  # packed query rows (tokens × group heads) per prefill program


def prefill_block_m(num_heads: int, num_kv_heads: int, block_rows: int = PREFILL_BLOCK_ROWS) -> int:
    """Query tokens per prefill program: `block_rows` packed rows hold this many tokens × the group."""
    return max(1, block_rows // next_power_of_2(num_heads // num_kv_heads))


def prefill_tiles(query_lens_cpu: list[int], seq_lens_cpu: list[int], block_m: int, device: torch.device) -> torch.Tensor:
    """The prefill grid's tiles, [2, num_tiles] int32 (request index; first query token), most work first.

    Under the causal mask a tile's work grows with the position of its queries, and the GPU
    starts programs in launch order: launching the heaviest first keeps the last wave short.
    """
    tiles_by_work = []
    for seq, query_len in enumerate(query_lens_cpu):
        num_cached = seq_lens_cpu[seq] - query_len
        for start in range(0, query_len, block_m):
            tiles_by_work.append((num_cached + start, seq, start))
    tiles_by_work.sort(reverse=True)
    # Rows padded to a multiple of 4 int32s, so that row 1 starts 16-byte aligned as row 0
    # does (see `aligned`); the kernel reads only the first num_tiles of each.
    num_tiles = len(tiles_by_work)
    padded = -(-num_tiles // 4) * 4
    tiles = torch.zeros(2, padded, dtype=torch.int32)
    if num_tiles:
        tiles[:, :num_tiles] = torch.tensor([[t[1] for t in tiles_by_work], [t[2] for t in tiles_by_work]], dtype=torch.int32)
    return tiles.to(device, non_blocking=True)[:, :num_tiles]


def paged_prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float, query_lens_cpu: list[int] | None = None,
    seq_lens_cpu: list[int] | None = None, tiles: torch.Tensor | None = None,
    block_rows: int = PREFILL_BLOCK_ROWS, block_n: int = 128, num_warps: int = 8, num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # Written into `out` ([num_tokens, num_heads, head_dim], unit stride in the last dim) when
    # given, else a new tensor.
    # Defaults from the same sweep: 128 packed query rows x 128 keys per tile, 8 warps,
    # 3 stages: 313 TFLOP/s causal at 4k tokens (SDPA flash 273 in that run).
    # `tiles` (from `prefill_tiles`) may be passed in: the backend builds them once per step.
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_m = prefill_block_m(num_heads, num_kv_heads, block_rows)  # query tokens per program
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1, "out must be [num_tokens, num_heads, head_dim], unit stride"
    if tiles is None:
        if query_lens_cpu is None:
            query_lens_cpu = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        if seq_lens_cpu is None:  # a device sync: the backend passes host copies
            seq_lens_cpu = seq_lens.tolist()
        tiles = prefill_tiles(query_lens_cpu, seq_lens_cpu, block_m, query.device)
    if tiles.shape[1] == 0:
        return out
    query, block_tables, seq_lens, query_start_loc = (aligned(t) for t in (query, block_tables, seq_lens, query_start_loc))
    # The KV head is the fastest-moving grid axis, so every head of a heavy tile starts early.
    _prefill_kernel[(num_kv_heads, tiles.shape[1])](
        query, kv_cache, block_tables, seq_lens, query_start_loc, tiles[0], tiles[1], out,
        scale * LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), num_kv_heads * head_dim, block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out

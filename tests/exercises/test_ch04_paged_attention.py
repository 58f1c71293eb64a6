"""Chapter 04 exercises: PagedAttention in PyTorch — write K/V into the paged cache, read it back.

The cache is [2, num_blocks, block_size, num_kv_heads, head_dim]. Blocks are handed out in a
shuffled order, so a request's context is scattered over the cache; slots nobody wrote hold
random values, so reading a wrong slot (or forgetting a mask) changes the answer. Every
attention result is compared with plain causal attention over contiguous K/V, written here
with matmul and softmax. Head counts give GQA ratios 3 and 4 (MQA), and contexts range from
shorter than one block to many blocks, never a multiple of the block size unless on purpose.

Calls go through the module (`torch_backend.reshape_and_cache`, `torch_backend.gather_kv`)
and the class (`TorchAttentionBackend._prefill`, `_decode`, `forward`), so `minivllm
exercise check 04` can swap your functions in.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from minivllm.attention import torch_backend
from minivllm.attention.metadata import AttentionMetadata

HEAD_DIM = 8


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, seed: int = 0) -> torch.Tensor:
    """A cache full of random values: whatever a wrong slot holds, it is not the right K/V."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=g) * 3


def slots_of(block_table: list[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query [q_len, H, D] are the last q_len positions of key/value [seq_len, H_kv, D]; causal."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads  # query heads per KV head
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale  # [H, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), value)


@dataclass
class PagedRequest:
    """One request's whole context: its K/V, its block table, and how much is new this step."""

    key: torch.Tensor  # [seq_len, H_kv, D]
    value: torch.Tensor
    query: torch.Tensor  # [query_len, H, D], the new tokens only
    block_table: list[int]

    @property
    def seq_len(self) -> int:
        return self.key.shape[0]

    @property
    def query_len(self) -> int:
        return self.query.shape[0]


def make_requests(
    specs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, num_blocks: int, seed: int = 1
) -> list[PagedRequest]:
    """(seq_len, query_len) per request; blocks drawn from a shuffled pool so tables interleave."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    requests = []
    for seq_len, query_len in specs:
        n = -(-seq_len // block_size)
        table, free = free[:n], free[n:]
        assert len(table) == n, "the test's pool is too small"
        requests.append(
            PagedRequest(
                key=torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=g),
                value=torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=g),
                query=torch.randn(query_len, num_heads, HEAD_DIM, generator=g),
                block_table=table,
            )
        )
    return requests


def write_context(cache: torch.Tensor, request: PagedRequest, end: int) -> None:
    """Put K/V of positions 0..end-1 into the cache by hand (what earlier steps did)."""
    block_size = cache.shape[2]
    for p in range(end):
        block, offset = request.block_table[p // block_size], p % block_size
        cache[0, block, offset] = request.key[p]
        cache[1, block, offset] = request.value[p]


def make_metadata(requests: list[PagedRequest], block_size: int) -> AttentionMetadata:
    """The metadata the model runner builds: decodes (one query token) must come first."""
    num_decodes = sum(1 for r in requests if r.query_len == 1)
    assert all(r.query_len == 1 for r in requests[:num_decodes]), "decode requests go first"
    query_start_loc = [0]
    slot_mapping: list[int] = []
    for r in requests:
        query_start_loc.append(query_start_loc[-1] + r.query_len)
        slot_mapping += slots_of(r.block_table, range(r.seq_len - r.query_len, r.seq_len), block_size)
    max_blocks = max(len(r.block_table) for r in requests)
    block_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in requests]  # padded with 0
    seq_lens = [r.seq_len for r in requests]
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        num_decodes=num_decodes,
        max_query_len=max(r.query_len for r in requests),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    assert err < 1e-4, f"{what}: differs from plain causal attention by up to {err:.3g}"


# -- reshape_and_cache ------------------------------------------------------------------------


@pytest.mark.exercise("ch04-reshape-and-cache")
def test_each_new_token_lands_in_its_slot_and_nothing_else_changes():
    block_size, num_kv_heads = 3, 2
    cache = random_cache(num_blocks=5, block_size=block_size, num_kv_heads=num_kv_heads)
    before = cache.clone()
    slots = [14, 0, 8, 3, 4, 5, 13]  # out of order, across blocks, one in block 0
    key = torch.randn(len(slots), num_kv_heads, HEAD_DIM)
    value = torch.randn(len(slots), num_kv_heads, HEAD_DIM)
    torch_backend.reshape_and_cache(key, value, cache, torch.tensor(slots))
    for t, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        assert torch.equal(cache[0, block, offset], key[t]), f"token {t}'s key should be in block {block}, offset {offset}"
        assert torch.equal(cache[1, block, offset], value[t]), f"token {t}'s value should be in block {block}, offset {offset}"
    written = torch.zeros(5 * block_size, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(5, block_size)
    assert torch.equal(cache[:, untouched], before[:, untouched]), "slots not in slot_mapping must not change"


@pytest.mark.exercise("ch04-reshape-and-cache")
def test_the_cache_is_written_in_place_from_strided_key_and_value():
    # The model hands over views into a fused qkv tensor: not contiguous. The cache object is
    # the one bound to the layer, so it must be changed in place, not replaced.
    block_size, num_kv_heads, num_tokens = 4, 1, 6
    cache = torch.zeros(2, 3, block_size, num_kv_heads, HEAD_DIM)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, HEAD_DIM)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    assert not key.is_contiguous()
    slots = slots_of([2, 0], range(1, 7), block_size)
    torch_backend.reshape_and_cache(key, value, cache, torch.tensor(slots))
    flat_k = cache[0].view(-1, num_kv_heads, HEAD_DIM)
    flat_v = cache[1].view(-1, num_kv_heads, HEAD_DIM)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)


# -- gather_kv --------------------------------------------------------------------------------


def expected_gather(cache: torch.Tensor, block_table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = cache.shape[2]
    rows = [(block_table[t // block_size], t % block_size) for t in range(seq_len)]
    return torch.stack([cache[0, b, o] for b, o in rows]), torch.stack([cache[1, b, o] for b, o in rows])


@pytest.mark.exercise("ch04-gather-kv")
@pytest.mark.parametrize(
    ("block_size", "block_table", "seq_len"),
    [
        (8, [4], 3),  # shorter than one block
        (4, [9, 2, 7, 0, 5], 14),  # many blocks, the last one partly filled
        (4, [1, 6], 8),  # exactly two full blocks
        (5, [3, 8, 0, 0, 0], 7),  # a row of block_tables, padded with 0 past its 2 blocks
        (1, [2, 0, 1], 3),  # block size 1
    ],
)
def test_gather_reads_the_first_seq_len_tokens_through_the_block_table(block_size, block_table, seq_len):
    cache = random_cache(num_blocks=10, block_size=block_size, num_kv_heads=3)
    key, value = torch_backend.gather_kv(cache, torch.tensor(block_table, dtype=torch.int32), seq_len)
    want_key, want_value = expected_gather(cache, block_table, seq_len)
    assert key.shape == (seq_len, 3, HEAD_DIM), f"expected [seq_len, num_kv_heads, head_dim], got {tuple(key.shape)}"
    assert torch.equal(key, want_key), "token t's key is at offset t % block_size of block block_table[t // block_size]"
    assert torch.equal(value, want_value), "values come from kv_cache[1], in the same slots as the keys"


# -- prefill attention ------------------------------------------------------------------------


@pytest.mark.exercise("ch04-prefill-attention")
@pytest.mark.parametrize(
    ("seq_len", "query_len", "block_size", "num_heads", "num_kv_heads"),
    [
        (11, 11, 4, 6, 2),  # a whole prompt, GQA ratio 3
        (13, 5, 4, 6, 2),  # a later chunk: 8 tokens already in the cache
        (3, 3, 16, 4, 1),  # a prompt shorter than one block, MQA (ratio 4)
        (30, 7, 3, 4, 1),  # a chunk deep into a context of 10 blocks
        (9, 1, 4, 6, 2),  # a one-token chunk at the end of a prompt
    ],
)
def test_prefill_attends_causally_over_the_cached_context(seq_len, query_len, block_size, num_heads, num_kv_heads):
    cache = random_cache(num_blocks=16, block_size=block_size, num_kv_heads=num_kv_heads)
    (request,) = make_requests([(seq_len, query_len)], block_size, num_heads, num_kv_heads, num_blocks=16)
    write_context(cache, request, seq_len)  # the chunk's own K/V are written before attention runs
    scale = HEAD_DIM**-0.5
    out = torch_backend.TorchAttentionBackend._prefill(
        request.query, cache, torch.tensor(request.block_table, dtype=torch.int32), seq_len, scale
    )
    want = dense_attention(request.query, request.key, request.value, scale)
    assert_close(out, want, f"{query_len} query tokens at the end of a {seq_len}-token context")


# -- decode attention -------------------------------------------------------------------------


@pytest.mark.exercise("ch04-decode-attention")
@pytest.mark.parametrize(
    ("seq_lens", "block_size", "num_heads", "num_kv_heads"),
    [
        ([1, 5, 17, 32], 4, 6, 2),  # very different lengths, GQA ratio 3
        ([2], 16, 4, 1),  # one request, shorter than a block, MQA
        ([23, 9, 40], 5, 4, 2),  # padded block tables, ratio 2
    ],
)
def test_decode_attends_each_request_to_its_own_context(seq_lens, block_size, num_heads, num_kv_heads):
    cache = random_cache(num_blocks=24, block_size=block_size, num_kv_heads=num_kv_heads)
    requests = make_requests([(n, 1) for n in seq_lens], block_size, num_heads, num_kv_heads, num_blocks=24)
    for r in requests:
        write_context(cache, r, r.seq_len)
    meta = make_metadata(requests, block_size)
    scale = HEAD_DIM**-0.5
    query = torch.cat([r.query for r in requests])
    out = torch_backend.TorchAttentionBackend._decode(query, cache, meta, scale)
    assert out.shape == query.shape, f"expected one row per decode request, {tuple(query.shape)}, got {tuple(out.shape)}"
    for i, r in enumerate(requests):
        want = dense_attention(r.query, r.key, r.value, scale)[0]
        assert_close(out[i], want, f"decode request {i} (context of {r.seq_len} tokens)")


# -- the whole backend: a mixed batch ---------------------------------------------------------


@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(e, marks=pytest.mark.exercise(e), id=e)
        for e in ["ch04-reshape-and-cache", "ch04-gather-kv", "ch04-prefill-attention", "ch04-decode-attention"]
    ],
)
def test_forward_on_a_batch_of_decodes_chunks_and_new_prompts(exercise_id):
    # Decodes first (as the model runner orders them), then a continued chunk, then new prompts.
    block_size, num_heads, num_kv_heads = 4, 6, 2
    specs = [(9, 1), (2, 1), (21, 1), (14, 6), (7, 7), (3, 3)]  # (seq_len, new tokens this step)
    cache = random_cache(num_blocks=20, block_size=block_size, num_kv_heads=num_kv_heads)
    requests = make_requests(specs, block_size, num_heads, num_kv_heads, num_blocks=20)
    for r in requests:
        write_context(cache, r, r.seq_len - r.query_len)  # only what earlier steps computed
    meta = make_metadata(requests, block_size)
    query = torch.cat([r.query for r in requests])
    key = torch.cat([r.key[r.seq_len - r.query_len :] for r in requests])
    value = torch.cat([r.value[r.seq_len - r.query_len :] for r in requests])
    scale = HEAD_DIM**-0.5
    out = torch_backend.TorchAttentionBackend().forward(query, key, value, cache, meta, scale)
    for i, r in enumerate(requests):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        want = dense_attention(r.query, r.key, r.value, scale)
        assert_close(out[start:end], want, f"request {i} ({r.query_len} new of {r.seq_len} tokens)")
        got_key, _ = expected_gather(cache, r.block_table, r.seq_len)
        assert torch.equal(got_key, r.key), f"request {i}: after the step, the cache must hold all {r.seq_len} keys"

"""Every Triton kernel against its PyTorch reference (chapter 06).

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), in
float32 and float16; on a GPU (tests marked `gpu`) natively in bfloat16. Shapes are drawn by
hypothesis: sizes that are not powers of two, GQA ratios 1/2/4/8, head_dim 64 and 128, block
sizes 16 and 32, contexts shorter than one block and spanning many. Cache blocks that a
request does not own are filled with NaN, so a kernel that reads outside its block table, or
writes outside its slots, poisons the result and fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.kernels import KERNELS

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# Relative error ‖out − ref‖ / ‖ref‖: fp32 arithmetic lands near 1e-7; fp16/bf16 operands
# (8–11 mantissa bits) with fp32 accumulation land between 1e-4 and 1e-2.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# The interpreter runs one program at a time (~1 ms each): few, larger examples.
FAST = settings(max_examples=6 if not CUDA else 30, deadline=None, suppress_health_check=list(HealthCheck))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out.float()).all(), "the kernel produced NaN/inf: it read memory it does not own"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def paged_problem(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """A paged KV cache whose unowned blocks are NaN, shuffled block tables, and queries."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = [order.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(ids)
        slots = torch.arange(seq_len)
        flat = kv_cache.flatten(1, 2)
        for kv in range(2):
            flat[kv, torch.tensor(ids)[slots // block_size] * block_size + slots % block_size] = torch.randn(
                seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(query), to(kv_cache), to(block_tables), to(torch.tensor(seq_lens, dtype=torch.int32))


def test_registry_lists_every_kernel_with_a_reference():
    assert set(KERNELS) == {"reshape_and_cache", "paged_decode_attention", "paged_prefill_attention",
                            "fused_add_rms_norm", "rotary_embedding", "qk_norm_rotary_embedding", "silu_and_mul",
                            "skinny_gemm", "rms_norm_skinny_gemm", "gumbel_sample", "argmax_sample",
                            "unpack_step_inputs"}
    for name, (kernel, reference) in KERNELS.items():
        assert reference.__name__ == f"{kernel.__name__}_reference", name


@FAST
@given(seq_lens=st.lists(st.integers(1, 150), min_size=1, max_size=4), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([64, 128]), block_size=st.sampled_from([16, 32]), splits=st.integers(1, 3),
       heads_fastest=st.booleans(), merge_in_kernel=st.booleans(), block_n=st.sampled_from([16, None]),
       min_split_tiles=st.sampled_from([None, 1, 3]), whole_context_tiles=st.sampled_from([None, 0, 2]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_paged_decode_attention(seq_lens, group, head_dim, block_size, splits, heads_fastest, merge_in_kernel,
                                block_n, min_split_tiles, whole_context_tiles, dtype, seed):
    # Both launch orders (sequences or KV heads fastest in the grid) and both merges (by the
    # last split to finish, or by a second kernel) compute the same thing; 16-token tiles
    # make even short contexts span several splits, each as long as its own context needs.
    kernel, reference = KERNELS["paged_decode_attention"]
    q, kv, bt, sl = paged_problem(seq_lens, [1] * len(seq_lens), 2, group, head_dim, block_size, dtype, seed)
    out = kernel(q, kv, bt, sl, head_dim**-0.5, num_splits=splits, heads_fastest=heads_fastest,
                 merge_in_kernel=merge_in_kernel, block_n=block_n, min_split_tiles=min_split_tiles,
                 whole_context_tiles=whole_context_tiles)
    assert rel_err(out, reference(q, kv, bt, sl, head_dim**-0.5)) < TOLERANCE[dtype]


@FAST
@given(seq_lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), bound=st.integers(200, 1200),
       splits=st.integers(2, 12), min_split_tiles=st.sampled_from([1, 2, 4]), whole_context_tiles=st.sampled_from([0, 4]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_decode_merge_by_the_last_split_as_a_cuda_graph_launches_it(seq_lens, bound, splits, min_split_tiles,
                                                                    whole_context_tiles, dtype, seed):
    """A CUDA graph launches the decode kernel for max_model_len: most splits of a short
    context are empty, and a context may fit in one split. The merging program must wait for
    exactly the splits that hold tokens, leave every counter at zero for the next launch, and
    give the same result launch after launch."""
    from minivllm.kernels.paged_attention import split_counters

    kernel, reference = KERNELS["paged_decode_attention"]
    q, kv, bt, sl = paged_problem(seq_lens, [1] * len(seq_lens), 2, 2, 64, 16, dtype, seed)
    ref = reference(q, kv, bt, sl, 64**-0.5)
    # 16-token tiles and splits of at least 16-64 tokens: a context of up to 200 spans 1 to 12
    # of them, each context its own split length, whatever the bound the launch was sized for
    # (and with whole_context_tiles=4, one of at most 64 tokens is not split).
    launch = dict(max_seq_len=bound, num_splits=splits, block_n=16, merge_in_kernel=True,
                  min_split_tiles=min_split_tiles, whole_context_tiles=whole_context_tiles)
    first = kernel(q, kv, bt, sl, 64**-0.5, **launch)
    assert rel_err(first, ref) < TOLERANCE[dtype]
    assert not split_counters(q.device, 0).any(), "a counter was left non-zero: the next launch would merge early"
    again = kernel(q, kv, bt, sl, 64**-0.5, **launch)
    assert torch.equal(first, again), "the merge must not depend on which split finished last"


@FAST
@given(seq_lens=st.lists(st.integers(1, 150), min_size=1, max_size=4), splits=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_paged_decode_attention_writes_only_the_rows_of_out(seq_lens, splits, dtype, seed):
    # The backend passes the first rows of its output buffer, and the query as a strided view
    # of the fused qkv projection: the kernel must honour both strides and touch nothing else.
    kernel, reference = KERNELS["paged_decode_attention"]
    q, kv, bt, sl = paged_problem(seq_lens, [1] * len(seq_lens), 2, 4, 64, 16, dtype, seed)
    qkv = torch.full((q.shape[0], q.shape[1] + 4, 64), float("nan"), dtype=dtype, device=DEVICE)
    qkv[:, : q.shape[1]] = q
    output = torch.full((q.shape[0] + 2, q.shape[1], 64), float("nan"), dtype=dtype, device=DEVICE)
    returned = kernel(qkv[:, : q.shape[1]], kv, bt, sl, 64**-0.5, num_splits=splits, out=output[: q.shape[0]])
    assert returned.data_ptr() == output.data_ptr()
    assert rel_err(output[: q.shape[0]], reference(q, kv, bt, sl, 64**-0.5)) < TOLERANCE[dtype]
    assert output[q.shape[0]:].isnan().all(), "the kernel wrote past the rows it was given"


@FAST
@given(data=st.data(), group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128]),
       block_size=st.sampled_from([16, 32]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_paged_prefill_attention(data, group, head_dim, block_size, dtype, seed):
    seq_lens = data.draw(st.lists(st.integers(1, 130), min_size=1, max_size=3))
    # Each request's queries are its last query_len tokens: a new prompt (all of them) or a
    # continued chunk / cached prefix (fewer).
    query_lens = [data.draw(st.integers(1, s)) for s in seq_lens]
    kernel, reference = KERNELS["paged_prefill_attention"]
    q, kv, bt, sl = paged_problem(seq_lens, query_lens, 2, group, head_dim, block_size, dtype, seed)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = kernel(q, kv, bt, sl, qsl, head_dim**-0.5)
    assert rel_err(out, reference(q, kv, bt, sl, qsl, head_dim**-0.5)) < TOLERANCE[dtype]


@FAST
@given(num_tokens=st.integers(1, 40), num_kv_heads=st.integers(1, 3), head_dim=st.sampled_from([64, 80]),
       block_size=st.sampled_from([16, 32]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_reshape_and_cache_writes_exactly_its_slots(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    kv_ref = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[0] = -1  # a padding token: must write nothing
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    kernel, reference = KERNELS["reshape_and_cache"]
    kernel(key, value, kv, slots.to(DEVICE))
    reference(key, value, kv_ref, slots.to(DEVICE))
    assert torch.equal(kv.isnan(), kv_ref.isnan()), "the kernel wrote outside its slots (or missed one)"
    assert torch.equal(kv.nan_to_num(), kv_ref.nan_to_num())


@FAST
@given(rows=st.integers(1, 9), hidden=st.integers(8, 700), with_residual=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_fused_add_rms_norm(rows, hidden, with_residual, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r, w = (torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in [(rows, hidden), (rows, hidden), (hidden,)])
    kernel, reference = KERNELS["fused_add_rms_norm"]
    out, res = kernel(x, r if with_residual else None, w, 1e-6)
    ref_out, ref_res = reference(x, r if with_residual else None, w, 1e-6)
    assert rel_err(out, ref_out) < TOLERANCE[dtype]
    assert torch.equal(res, ref_res), "the new residual is x + residual, rounded to the model dtype"


@FAST
@given(num_tokens=st.integers(1, 20), heads=st.sampled_from([(4, 1), (6, 2), (5, 5)]), head_dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rotary_embedding(num_tokens, heads, head_dim, dtype, seed):
    from minivllm.models.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cache = RotaryEmbedding(head_dim, 300, 500000.0, scaling).cos_sin_cache.to(DEVICE)
    positions = torch.randint(0, 300, (num_tokens,), generator=g).to(DEVICE)
    q = torch.randn(num_tokens, heads[0], head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(num_tokens, heads[1], head_dim, generator=g).to(dtype).to(DEVICE)
    kernel, reference = KERNELS["rotary_embedding"]
    ref_q, ref_k = reference(positions, q, k, cache)
    out_q, out_k = kernel(positions, q.clone(), k.clone(), cache)
    assert rel_err(out_q, ref_q) < TOLERANCE[dtype] and rel_err(out_k, ref_k) < TOLERANCE[dtype]


@FAST
@given(num_tokens=st.integers(1, 20), heads=st.sampled_from([(4, 1), (6, 2), (5, 5)]), head_dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_qk_norm_rotary_embedding_in_place_on_the_qkv_projection(num_tokens, heads, head_dim, dtype, seed):
    # As Qwen3 calls it: q and k are strided views of one qkv row per token; v must not change.
    from minivllm.models.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    cache = RotaryEmbedding(head_dim, 300, 1000000.0).cos_sin_cache.to(DEVICE)
    positions = torch.randint(0, 300, (num_tokens,), generator=g).to(DEVICE)
    num_q, num_k = heads
    qkv = (3 * torch.randn(num_tokens, (num_q + 2 * num_k) * head_dim, generator=g)).to(dtype).to(DEVICE)
    q_weight = (1 + torch.rand(head_dim, generator=g)).to(dtype).to(DEVICE)
    k_weight = (1 + torch.rand(head_dim, generator=g)).to(dtype).to(DEVICE)
    before = qkv.clone()
    q = qkv[:, : num_q * head_dim].view(num_tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(num_tokens, num_k, head_dim)
    kernel, reference = KERNELS["qk_norm_rotary_embedding"]
    ref_q, ref_k = reference(positions, q.clone(), k.clone(), cache, q_weight, k_weight, 1e-6)
    out_q, out_k = kernel(positions, q, k, cache, q_weight, k_weight, 1e-6)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "in place"
    assert rel_err(out_q, ref_q) < TOLERANCE[dtype] and rel_err(out_k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (num_q + num_k) * head_dim :], before[:, (num_q + num_k) * head_dim :]), "v changed"


@FAST
@given(num_tokens=st.integers(1, 12), padding=st.integers(0, 3), heads=st.sampled_from([(4, 1), (6, 2), (8, 8)]),
       head_dim=st.sampled_from([64, 128]), qk_norm=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_rotary_embedding_writes_the_rotated_key_and_the_value_into_the_cache(
    num_tokens, padding, heads, head_dim, qk_norm, dtype, seed
):
    """The fused RoPE + cache write: q and k rotated in place as before, the rotated k and
    the unchanged v at each token's slot, nothing for slot -1 or for rows past the slot
    mapping (a padded batch), and no other byte of the cache touched."""
    from minivllm.models.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    num_q, num_k = heads
    block_size = 16
    cache = RotaryEmbedding(head_dim, 300, 10000.0).cos_sin_cache.to(DEVICE)
    total = num_tokens + padding
    positions = torch.randint(0, 300, (total,), generator=g).to(DEVICE)
    qkv = torch.randn(total, (num_q + 2 * num_k) * head_dim, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : num_q * head_dim].view(total, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(total, num_k, head_dim)
    v = qkv[:, (num_q + num_k) * head_dim :].view(total, num_k, head_dim)
    num_blocks = -(-num_tokens // block_size) + 2
    kv = torch.full((2, num_blocks, block_size, num_k, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[0] = -1  # a padding token inside the batch
    slots = slots.to(DEVICE)
    weights = [(1 + torch.rand(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2)] if qk_norm else []
    name = "qk_norm_rotary_embedding" if qk_norm else "rotary_embedding"
    kernel, reference = KERNELS[name]
    norm_args = (*weights, 1e-6) if qk_norm else ()
    kv_ref = kv.clone()
    ref_q, ref_k = reference(positions, q.clone(), k.clone(), cache, *norm_args, v.clone(), kv_ref, slots)
    out_q, out_k = kernel(positions, q, k, cache, *norm_args, v, kv, slots)
    assert rel_err(out_q, ref_q) < TOLERANCE[dtype] and rel_err(out_k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(kv.isnan(), kv_ref.isnan()), "the kernel wrote outside its slots (or missed one)"
    assert rel_err(kv.nan_to_num(), kv_ref.nan_to_num()) < TOLERANCE[dtype]
    assert torch.equal(kv[1].nan_to_num(), kv_ref[1].nan_to_num()), "v goes into the cache unchanged"


@FAST
@given(rows=st.integers(1, 7), d=st.integers(1, 1500), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_silu_and_mul(rows, d, dtype, seed):
    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    kernel, reference = KERNELS["silu_and_mul"]
    assert rel_err(kernel(x), reference(x)) < TOLERANCE[dtype]


@FAST
@given(tokens=st.integers(1, 8), n=st.integers(1, 300), k=st.integers(1, 700), with_bias=st.booleans(),
       sum_each_slice=st.booleans(), gated=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_skinny_gemm(tokens, n, k, with_bias, sum_each_slice, gated, dtype, seed):
    # gated: x holds [gate | up] (2k columns) and the product's input is silu(gate) * up.
    g = torch.Generator().manual_seed(seed)
    x_shape = (tokens, 2 * k if gated else k)
    x, weight, bias = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for shape in (x_shape, (n, k), (n,)))
    kernel, reference = KERNELS["skinny_gemm"]
    # A 64-wide K slice, so that most drawn K end mid-slice and the masks are exercised.
    out = kernel(x, weight, bias if with_bias else None, gated, block_k=64, sum_each_slice=sum_each_slice)
    assert out.shape == (tokens, n)
    want = reference(x, weight, bias if with_bias else None, gated)
    # Error against the size of the terms summed (|input| @ |weight|.T + |bias|), not of the
    # result: a sum that cancels has a tiny result, and then one ulp of rounding where the
    # kernel's fp32 SiLU and torch's round an input differently is a large relative error of
    # it (seen at 0.03-0.12 on bf16, gated, n = 1-3), though the kernel is as exact as it can be.
    gated_in = reference(x, torch.eye(k, dtype=dtype, device=DEVICE), None, True) if gated else x
    terms = gated_in.float().abs() @ weight.float().abs().T + (bias.float().abs() if with_bias else 0)
    assert ((out.float() - want.float()).abs() / terms.clamp_min(1e-30)).max() < TOLERANCE[dtype]


def _use_kernels_on_the_cpu(monkeypatch, layer_module) -> list[str]:
    """Make the model layers (custom_ops and `layer_module`) take their Triton kernels on the
    CPU, through the interpreter; returns the list the names of the kernels called go into."""
    import minivllm.models.layers.custom_ops as custom_ops

    called = []
    real_call_kernel = custom_ops.call_kernel
    monkeypatch.setattr(custom_ops, "call_kernel", lambda name, *a, **kw: called.append(name) or real_call_kernel(name, *a, **kw))
    monkeypatch.setattr(layer_module, "call_kernel", custom_ops.call_kernel)
    for module in (custom_ops, layer_module):
        monkeypatch.setattr(module, "use_triton_ops", lambda t: True)
    return called


@pytest.mark.parametrize("tokens", [1, 4, 5])
def test_mlp_block_on_the_kernels_matches_the_torch_block(monkeypatch, tokens):
    """LlamaMLP on the kernels (on the CPU through Triton's interpreter): for up to 4 tokens
    the down product's skinny kernel does SiLU-and-mul itself, for 5 the separate kernel
    does. The output matches the layer's torch code."""
    from types import SimpleNamespace

    import minivllm.models.layers.activation as activation
    from minivllm.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(tokens)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=48, intermediate_size=80, hidden_act="silu")).to(DEVICE)
    for param in mlp.parameters():
        param.data = torch.randn(param.shape, generator=g).to(DEVICE) * 0.3
    x = torch.randn(tokens, 48, generator=g).to(DEVICE)
    want = mlp(x)  # the torch code (no kernels on the CPU)
    called = _use_kernels_on_the_cpu(monkeypatch, activation)
    out = mlp(x)
    assert ("silu_and_mul" in called) == (tokens > 4)
    assert rel_err(out, want) < 1e-4  # float32; the kernels sum in another order than torch


@FAST
@given(tokens=st.integers(1, 8), n=st.integers(1, 300), k=st.integers(1, 700), with_residual=st.booleans(),
       with_bias=st.booleans(), block_k=st.sampled_from([64, None]), norm_weight_ahead=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rms_norm_skinny_gemm(tokens, n, k, with_residual, with_bias, block_k, norm_weight_ahead, dtype, seed):
    """The add + RMSNorm inside the product against the norm kernel's reference, then the
    product's. The new residual is the same sum the norm kernel stores: bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x, residual, weight = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for shape in ((tokens, k), (tokens, k), (n, k)))
    norm_weight, bias = (torch.rand(*shape, generator=g).add(0.5).to(dtype).to(DEVICE) for shape in ((k,), (n,)))
    residual = residual if with_residual else None
    bias = bias if with_bias else None
    kernel, reference = KERNELS["rms_norm_skinny_gemm"]
    # 64-wide slices: most drawn K end mid-slice, and the row's sum of squares spans several slices.
    out, new_residual = kernel(x, residual, norm_weight, 1e-6, weight, bias, block_k=block_k,
                               norm_weight_ahead=norm_weight_ahead)
    want, want_residual = reference(x, residual, norm_weight, 1e-6, weight, bias)
    assert out.shape == (tokens, n) and new_residual.shape == (tokens, k)
    assert torch.equal(new_residual, want_residual)
    if residual is None:
        assert new_residual is x  # nothing to add: the input is the residual
    # As in test_skinny_gemm, the error is measured against the size of the summed terms. The
    # reference rounds the normalized row to the model dtype before the product and the kernel
    # does not (it never stores it): a difference of that rounding, within TOLERANCE in bf16/fp16.
    normed = reference(x, residual, norm_weight, 1e-6, torch.eye(k, dtype=dtype, device=DEVICE))[0]
    terms = normed.float().abs() @ weight.float().abs().T + (bias.float().abs() if with_bias else 0)
    assert ((out.float() - want.float()).abs() / terms.clamp_min(1e-30)).max() < TOLERANCE[dtype]


def test_rms_norm_skinny_gemm_refuses_a_norm_of_another_width():
    kernel, _ = KERNELS["rms_norm_skinny_gemm"]
    x = torch.randn(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm weight has shape \(8,\), the product needs \(16,\)"):
        kernel(x, None, torch.ones(8, device=DEVICE), 1e-6, torch.randn(4, 16, device=DEVICE))


@pytest.mark.parametrize("tokens,with_residual", [(1, True), (1, False), (2, True)])
def test_rms_norm_linear_on_the_kernels_matches_the_torch_code(monkeypatch, tokens, with_residual):
    """`rms_norm_linear` on the kernels (on the CPU through Triton's interpreter): for one token
    the product does the add and the norm (no norm kernel runs), for two the norm kernel runs
    before it. Both match the torch code; the new residual bit for bit."""
    import minivllm.models.layers.norm as norm_module
    from minivllm.models.layers.linear import MergedColumnParallelLinear
    from minivllm.models.layers.norm import RMSNorm, rms_norm_linear

    g = torch.Generator().manual_seed(tokens)
    norm, proj = RMSNorm(48).to(DEVICE), MergedColumnParallelLinear(48, [40, 40]).to(DEVICE)
    for param in (*norm.parameters(), *proj.parameters()):
        param.data = torch.randn(param.shape, generator=g).to(DEVICE) * 0.3 + 1.0
    x, residual = (torch.randn(tokens, 48, generator=g).to(DEVICE) for _ in range(2))
    residual = residual if with_residual else None
    want, want_residual = rms_norm_linear(norm, proj, x, residual)  # the torch code (no kernels on the CPU)
    called = _use_kernels_on_the_cpu(monkeypatch, norm_module)
    out, new_residual = rms_norm_linear(norm, proj, x, residual)
    if tokens == 1:
        assert called == ["rms_norm_skinny_gemm"]
    else:
        assert called[0] == "fused_add_rms_norm" and "rms_norm_skinny_gemm" not in called
    assert torch.equal(new_residual, want_residual)
    assert rel_err(out, want) < 1e-4  # float32; the kernel sums in another order than torch


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="forces the kernels on the CPU, through Triton's interpreter")
def test_a_model_decodes_the_same_tokens_with_the_norm_inside_its_products(monkeypatch, tmp_path):
    """A tiny Qwen3 through the engine, its products and norms on the kernels: one request, so
    every decode step has one token and each layer's two pre-norms go inside qkv and gate_up
    (layer 0's first one with no residual to add). The greedy tokens equal those with the norm
    kernel before each product."""
    import minivllm.kernels.gemm as gemm
    import minivllm.models.layers.norm as norm_module
    from hf_reference import make_tiny_model
    from minivllm import LLM, SamplingParams

    folder = make_tiny_model("qwen3", tmp_path)
    called = _use_kernels_on_the_cpu(monkeypatch, norm_module)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False)

    def greedy() -> list[int]:
        llm = LLM(str(folder), skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64,
                  num_gpu_blocks_override=16)
        # A fresh checkpoint's norm weights are all ones: make them matter.
        g = torch.Generator().manual_seed(0)
        for module in llm.llm_engine.engine_core.executor.worker.model_runner.model.modules():
            if isinstance(module, norm_module.RMSNorm):
                module.weight.data = torch.rand(module.weight.shape, generator=g) + 0.5
        return llm.generate([{"prompt_token_ids": [5, 17, 42, 7, 99, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids

    monkeypatch.setattr(gemm, "NORM_IN_PRODUCT_MAX_TOKENS", 0)
    with_norm_kernel = greedy()
    assert "rms_norm_skinny_gemm" not in called
    monkeypatch.setattr(gemm, "NORM_IN_PRODUCT_MAX_TOKENS", 1)
    called.clear()
    assert greedy() == with_norm_kernel
    # 4 one-token decode steps (the prefill's 6 tokens keep the norm kernel), 2 layers, 2 norms each.
    assert called.count("rms_norm_skinny_gemm") == 4 * 2 * 2


def test_the_norm_goes_into_the_product_only_where_it_was_measured_faster():
    """`norm_in_product_wins` against the recorded engine runs (an H100, the norm inside every
    one-token product after it, and not): faster for Qwen3-0.6B's one-slice products (K = 1,024)
    in every run, slower for Llama-3.2-1B's two-slice ones (K = 2,048)."""
    import json
    from pathlib import Path

    from minivllm.kernels.gemm import norm_in_product_wins

    data = json.loads((Path(__file__).resolve().parent.parent / "docs" / "data" / "norm-in-product-h100-2026-12-08.json").read_text())
    runs = {**data["first_call"], **{f"{k}-second": v for k, v in data["second_call_qwen3"].items()}}

    def replay(shape, variant, suffix):
        return runs[f"latency-{shape}-norm-in-product={variant}-{suffix}"]["points"][0]["graph_replay_ms"]

    for suffix in ("1", "1-second", "2-second"):
        assert replay("qwen3-0.6b", 1, suffix) < replay("qwen3-0.6b", 0, suffix), suffix
    assert replay("llama-3.2-1b", 1, "1") > replay("llama-3.2-1b", 0, "1")
    assert norm_in_product_wins(1, 1024) and not norm_in_product_wins(1, 2048)
    assert not norm_in_product_wins(2, 1024)  # two tokens: qkv and gate_up go to cuBLAS, with the norm kernel


def test_skinny_gemm_refuses_more_tokens_than_it_is_for():
    from minivllm.kernels import SKINNY_MAX_TOKENS

    kernel, _ = KERNELS["skinny_gemm"]
    with pytest.raises(ValueError, match="at most"):
        kernel(torch.zeros(SKINNY_MAX_TOKENS + 1, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE))


def test_skinny_gemm_is_picked_only_where_it_was_measured_faster():
    """`skinny_gemm_wins` against the recorded measurements. From two tokens on, every product
    it sends to the kernel ran faster in the H200 sweep with the sweep's tile (SKINNY_TILE, from
    which that rule was set) than with cuBLAS, and it picks some of them. For one token it picks
    every product, the sweep's losers too, because in the whole engine (under PDL, with the 1-2
    token tile, where a sweep of isolated products cannot judge) the batch-1 step of both shapes
    was faster so (`skinny-few=1`) and the batch-2 step slower with every 2-token product on it."""
    import json
    from pathlib import Path

    from minivllm.kernels.gemm import SKINNY_TILE, skinny_gemm_wins

    data_dir = Path(__file__).parents[1] / "docs/data"
    data = json.loads((data_dir / "skinny-gemm-h200-2026-12-03.json").read_text())
    keys = ("block_n", "block_k", "num_warps", "num_stages", "sum_each_slice")
    picked = 0
    for row in data["skinny_gemm_sweep"]["shapes"]:
        if row["tokens"] == 1:
            assert skinny_gemm_wins(1, row["N"], row["K"]), (row["model"], row["matrix"])
            continue
        if not skinny_gemm_wins(row["tokens"], row["N"], row["K"]):
            continue
        picked += 1
        tile = next(v for v in row["top"] if tuple(v[k] for k in keys) == SKINNY_TILE)
        assert tile["us"] < row["cublas_us"], (row["model"], row["matrix"], row["tokens"])
    assert picked >= 3

    engine = json.loads((data_dir / "skinny-one-token-h100-2026-12-07.json").read_text())["latency"]
    for shape in ("qwen3-0.6b", "llama-3.2-1b"):
        step = {variant: {p["batch_size"]: p["decode_step_ms"] for p in engine[f"latency-{shape}-{variant}-1"]["points"]}
                for variant in ("default", "skinny-few=1", "skinny-few=2")}
        assert step["skinny-few=1"][1] < step["default"][1], shape  # one token: every product on the kernel
        assert step["skinny-few=2"][2] > step["default"][2], shape  # two tokens: the sweep's rule


@settings(max_examples=4 if not CUDA else 30, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_rows=st.integers(1, 5), vocab_size=st.integers(2, 7000), dtype=st.sampled_from(DTYPES + [torch.float32]),
       seed=st.integers(0, 2**31 - 1), num_splits=st.integers(1, 4), data=st.data())
def test_gumbel_sample_picks_the_reference_token(num_rows, vocab_size, dtype, seed, num_splits, data):
    """Kernel and reference score every token from the same uniforms: the same token, however
    the rows are split, except where the best two scores of a row lie within float rounding
    (the kernel's log and the reference's may round differently there)."""
    kernel, reference = KERNELS["gumbel_sample"]
    from minivllm.kernels.sampling import gumbel_max_scores, gumbel_uniforms

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab_size + 3, generator=g) * 3).to(dtype).to(DEVICE)[:, :vocab_size]  # a row stride > V
    logits[:, data.draw(st.integers(0, vocab_size - 1))] = float("-inf")  # a masked token
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0, 1.7]), min_size=num_rows,
                                                  max_size=num_rows)), device=DEVICE)
    out, ref = kernel(logits, temperature, seed, num_splits=num_splits), reference(logits, temperature, seed)
    uniforms = gumbel_uniforms(num_rows, vocab_size, seed, logits.device)
    scores = gumbel_max_scores(logits, temperature, uniforms)
    top2 = scores.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs().clamp_min(1.0)
    assert out.dtype == torch.int64 and out.shape == (num_rows,)
    assert torch.equal(out[decided], ref[decided]), f"kernel {out.tolist()} vs reference {ref.tolist()}"
    assert torch.equal(out[temperature == 0], logits.float().argmax(-1)[temperature == 0]), "greedy rows take the argmax"


@settings(max_examples=4 if not CUDA else 30, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_rows=st.integers(1, 4), vocab_size=st.integers(2, 7000), dtype=st.sampled_from(DTYPES + [torch.float32]),
       seed=st.integers(0, 2**16), num_splits=st.sampled_from([None, 1, 3]), data=st.data())
def test_argmax_sample_is_the_argmax_with_the_lowest_token_among_ties(num_rows, vocab_size, dtype, seed, num_splits,
                                                                       data):
    """The greedy batch's kernel (the Gumbel kernel with its noise off): each row's argmax,
    however the row is split; a tie between two tokens goes to the lower one, as torch.argmax
    does, and a masked (-inf) token never wins."""
    kernel, reference = KERNELS["argmax_sample"]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size + 5, generator=g).to(dtype)[:, :vocab_size]  # a row stride > V
    if vocab_size > 2:
        if vocab_size > 512:  # 512 apart: the same lane of the kernel, which must keep the first
            low = data.draw(st.integers(0, vocab_size - 513))
            high = low + 512
        else:
            low, high = sorted(data.draw(st.lists(st.integers(0, vocab_size - 1), min_size=2, max_size=2, unique=True)))
        logits[0, low] = logits[0, high] = 40.0  # a tie for the top: the lower token
        masked = data.draw(st.integers(0, vocab_size - 1).filter(lambda t: num_rows > 1 or t not in (low, high)))
        logits[-1, masked] = float("-inf")
    logits = logits.to(DEVICE)
    out, ref = kernel(logits, num_splits=num_splits), reference(logits)
    assert out.dtype == torch.int64 and torch.equal(out, ref), f"kernel {out.tolist()} vs argmax {ref.tolist()}"
    if vocab_size > 2:
        assert out[0].item() == low


@FAST
@given(num_tokens=st.integers(1, 1500), num_reqs=st.integers(1, 6), width=st.integers(1, 5),
       gather_logits=st.booleans(), seed=st.integers(0, 2**16))
def test_unpack_step_inputs_writes_every_array_where_the_model_reads_it(num_tokens, num_reqs, width, gather_logits,
                                                                       seed):
    """One packed buffer (as the model runner stages a step) into the seven device buffers:
    each array in place, int32 widened to int64 where the buffer is, block-table rows at the
    buffer's stride and only `width` columns wide (the others keep what they held), and a
    token id -(r + 1) replaced by row r of the last step's sampled tokens. Every buffer starts
    full of -7, so a write to a wrong place, or a missing one, shows."""
    from minivllm.executor.step_inputs import (BLOCK_TABLES, HEADER_WORDS, INPUT_IDS, LOGITS_INDICES, POSITIONS,
                                               QUERY_START_LOC, SEQ_LENS, SLOT_MAPPING, StepInputStager)

    kernel, reference = KERNELS["unpack_step_inputs"]
    g = torch.Generator().manual_seed(seed)
    stage = StepInputStager(HEADER_WORDS + 3 * 1500 + 3 * 8 + 8 * 6, torch.device("cpu"))  # the host side only
    stage.start()
    ids = stage.take(INPUT_IDS, num_tokens)
    ids[:] = torch.randint(0, 50_000, (num_tokens,), generator=g).numpy()
    pending = torch.randperm(num_tokens, generator=g)[: min(num_tokens, num_reqs)]
    sampled_rows = torch.randint(0, 6, (len(pending),), generator=g)
    ids[pending.numpy()] = -(sampled_rows.numpy() + 1)
    stage.take(POSITIONS, num_tokens)[:] = torch.randint(0, 4096, (num_tokens,), generator=g).numpy()
    stage.take(SLOT_MAPPING, num_tokens)[:] = torch.randint(-1, 10_000, (num_tokens,), generator=g).numpy()
    stage.take(QUERY_START_LOC, num_reqs + 1)[:] = torch.arange(num_reqs + 1).numpy() * 3
    stage.take(SEQ_LENS, num_reqs)[:] = torch.randint(1, 80, (num_reqs,), generator=g).numpy()
    table = torch.randint(0, 900, (num_reqs, width), generator=g)
    stage.take_rows(BLOCK_TABLES, num_reqs, width)[:] = table.numpy()
    if gather_logits:
        stage.take(LOGITS_INDICES, num_reqs)[:] = torch.randint(0, num_tokens, (num_reqs,), generator=g).numpy()
    staged = stage.host[: stage.end].to(DEVICE)
    last_sampled = torch.randint(0, 50_000, (6,), generator=g).to(DEVICE)

    def buffers():
        long, int32 = dict(dtype=torch.long, device=DEVICE), dict(dtype=torch.int32, device=DEVICE)
        return (torch.full((1600,), -7, **long), torch.full((1600,), -7, **long), torch.full((1600,), -7, **long),
                torch.full((9,), -7, **int32), torch.full((8,), -7, **int32), torch.full((8, 7), -7, **int32),
                torch.full((8,), -7, **long))

    got, want = buffers(), buffers()
    kernel(staged, stage.max_length, *got, last_sampled)
    reference(staged.clone(), stage.max_length, *want, last_sampled)
    for name, a, b in zip(("input_ids", "positions", "slots", "qsl", "seq_lens", "block_tables", "logits"), got, want):
        assert torch.equal(a, b), name
    expected_ids = torch.from_numpy(ids.astype("int64")).to(DEVICE)
    expected_ids[pending.to(DEVICE)] = last_sampled[sampled_rows.to(DEVICE)]
    assert torch.equal(got[0][:num_tokens], expected_ids), "pending ids take the last step's sampled tokens"
    assert torch.equal(got[5][:num_reqs, :width].cpu(), table.int()) and (got[5][:, width:] == -7).all()
    assert (got[0][num_tokens:] == -7).all() and (got[6] == -7).all() != gather_logits


def test_gumbel_uniforms_are_uniform_and_fresh_for_every_token_and_seed():
    """The noise itself: uniform on (0, 1) (mean, deciles), different for every token, row and seed."""
    from minivllm.kernels.sampling import gumbel_uniforms

    u = gumbel_uniforms(3, 4000, 11, torch.device(DEVICE)).cpu().double()
    assert (u > 0).all() and (u < 1).all()
    n = u.numel()  # 12,000 draws: the mean has sd 0.29 / sqrt(n) = 0.0026; a decile's share sd 0.0027
    assert abs(u.mean().item() - 0.5) < 5 * 0.0026
    shares = torch.histc(u, bins=10, min=0, max=1) / n
    assert (shares - 0.1).abs().max() < 5 * 0.0027, shares
    assert len(torch.unique(u)) > 0.99 * n, "tokens or rows share their noise"
    assert not torch.equal(u, gumbel_uniforms(3, 4000, 12, torch.device(DEVICE)).cpu().double()), "the seed must matter"


def test_gumbel_max_samples_softmax_of_logits_over_temperature():
    """The reference's formula with fresh uniforms, 200,000 draws per temperature, against
    softmax(logits / T). A token of probability q appears Binomial(N, q) times: sd of its
    frequency <= 0.5 / sqrt(N) = 0.0011; we allow 5 sd (a correct formula fails with
    probability < 1e-6 per token; the seed is fixed). Using T instead of 1/T, or dropping it,
    moves the top token by more than 0.1 at these temperatures."""
    from minivllm.kernels.sampling import gumbel_max

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    n = 200_000
    g = torch.Generator().manual_seed(0)
    for t in (0.5, 2.0):
        tokens = gumbel_max(logits.expand(n, -1), torch.full((n,), t), torch.rand(n, 6, generator=g))
        freq = torch.bincount(tokens, minlength=6).double() / n
        expected = torch.softmax(logits.double() / t, -1)
        assert ((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt()).all(), (t, freq, expected)


def test_gumbel_sample_refuses_what_it_cannot_draw():
    kernel, _ = KERNELS["gumbel_sample"]
    logits = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="seed"):
        kernel(logits, torch.ones(2, device=DEVICE), 2**31)
    with pytest.raises(ValueError, match="unit stride"):
        kernel(logits.t(), torch.ones(8, device=DEVICE), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the interpreter draws a row in ~10 ms")
def test_gumbel_sample_kernel_draws_follow_softmax_on_the_gpu():
    """The kernel's own draws (not only its formula): 100,000 rows of one distribution."""
    kernel, _ = KERNELS["gumbel_sample"]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")], device="cuda")
    n = 100_000  # sd of a frequency <= 0.0016; 5 sd allowed, as in the test above
    for t in (0.5, 2.0):
        tokens = kernel(logits.expand(n, -1).to(torch.bfloat16).contiguous(), torch.full((n,), t, device="cuda"), 5)
        freq = torch.bincount(tokens, minlength=6).double().cpu() / n
        expected = torch.softmax(logits.double().cpu() / t, -1)
        assert ((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt()).all(), (t, freq, expected)


def test_check_mode_raises_on_a_wrong_kernel(monkeypatch):
    import minivllm.kernels as kernels

    monkeypatch.setenv("MINIVLLM_CHECK_KERNELS", "1")
    good = kernels.KERNELS["silu_and_mul"]
    monkeypatch.setitem(kernels.KERNELS, "silu_and_mul", (lambda x: good[1](x) * 1.5, good[1]))
    with pytest.raises(AssertionError, match="silu_and_mul disagrees"):
        kernels.call_kernel("silu_and_mul", torch.randn(3, 8, device=DEVICE))


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from minivllm.attention.torch_backend import get_attention_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", torch.device("cpu"))


def test_prefill_tiles_cover_every_query_once_heaviest_first():
    from minivllm.kernels import prefill_tiles

    # Request 0: a 70-token prompt; request 1: a 20-token chunk after 100 cached tokens.
    tiles = prefill_tiles([70, 20], [70, 120], 32, torch.device("cpu")).tolist()
    pairs = list(zip(*tiles))
    assert sorted(pairs) == [(0, 0), (0, 32), (0, 64), (1, 0)]
    # Work grows with the position of a tile's queries: 100 cached + 0, then 64, 32, 0.
    assert pairs == [(1, 0), (0, 64), (0, 32), (0, 0)]


def _layer_chain(x, residual, w_norm, w_qkv, w_o, w_up, w_down, cos_sin, positions, kv, slots, bt, seq_lens, splits,
                 norm_in_product=False):
    """A decoder layer's kernels at batch 1, each reading the one before: norm, qkv product,
    RoPE writing the cache, decode attention over that cache (several splits, merged in
    the kernel), o product, norm, gate/up product, down product with SiLU-and-mul in it, and
    the separate SiLU-and-mul kernel (summed into the output, to be checked too). With
    `norm_in_product`, the first norm is done inside the qkv product (its new residual is
    stored by one program and read by the second norm, four kernels later)."""
    call = {name: kernel for name, (kernel, _) in KERNELS.items()}
    if norm_in_product:
        qkv, residual = call["rms_norm_skinny_gemm"](x, residual, w_norm, 1e-6, w_qkv)
    else:
        h, residual = call["fused_add_rms_norm"](x, residual, w_norm, 1e-6)
        qkv = call["skinny_gemm"](h, w_qkv)
    q, k, v = qkv.view(1, 12, 128).split([8, 2, 2], dim=1)
    q, k = call["rotary_embedding"](positions, q, k, cos_sin, v, kv, slots)
    attn = call["paged_decode_attention"](q, kv, bt, seq_lens, 128**-0.5, max_seq_len=2048, num_splits=splits)
    o = call["skinny_gemm"](attn.view(1, -1), w_o)
    h, residual = call["fused_add_rms_norm"](o, residual, w_norm, 1e-6)
    gate_up = call["skinny_gemm"](h, w_up)
    return call["skinny_gemm"](gate_up, w_down, None, True) + call["silu_and_mul"](gate_up).sum(), residual


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper (or newer) GPU")
@pytest.mark.parametrize("norm_in_product", [False, True])
def test_programmatic_dependent_launch_changes_no_bit_in_a_cuda_graph(monkeypatch, norm_in_product):
    """With PDL each kernel starts before the previous one ends and waits (gdc_wait) before
    reading its output. A kernel that read too early would see the previous step's values:
    the chain replayed in a CUDA graph, with new inputs each time, must give exactly what
    the same kernels give launched one after another without PDL."""
    from minivllm.kernels._utils import pdl_enabled
    from minivllm.models.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.5).to(torch.bfloat16).cuda()  # noqa: E731
    w_norm, w_qkv, w_o, w_up = rand(1024), rand(12 * 128, 1024), rand(1024, 8 * 128), rand(2 * 2048, 1024)
    w_down = rand(1024, 2048)
    cos_sin = RotaryEmbedding(128, 4096, 10000.0).cos_sin_cache.cuda()
    kv = rand(2, 64, 16, 2, 128)
    bt = torch.randperm(64, generator=g)[:32].to(torch.int32).view(1, 32).cuda()
    static = {"x": rand(1, 1024), "residual": rand(1, 1024), "positions": torch.zeros(1, dtype=torch.long).cuda(),
              "slots": torch.zeros(1, dtype=torch.long).cuda(), "seq_lens": torch.zeros(1, dtype=torch.int32).cuda()}

    def step_inputs(seq_len):
        pos = seq_len - 1
        slot = int(bt[0, pos // 16]) * 16 + pos % 16
        return {"x": rand(1, 1024), "residual": rand(1, 1024), "positions": torch.tensor([pos]).cuda(),
                "slots": torch.tensor([slot]).cuda(), "seq_lens": torch.tensor([seq_len], dtype=torch.int32).cuda()}

    def run(inputs, cache):
        return _layer_chain(inputs["x"], inputs["residual"], w_norm, w_qkv, w_o, w_up, w_down, cos_sin, inputs["positions"],
                            cache, inputs["slots"], bt, inputs["seq_lens"], splits=16, norm_in_product=norm_in_product)

    monkeypatch.setenv("MINIVLLM_PDL", "1")
    assert pdl_enabled(torch.device("cuda"))
    run(static, kv.clone())  # compile outside the capture
    graph_cache = kv.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run(static, graph_cache)
    monkeypatch.setenv("MINIVLLM_PDL", "0")
    eager_cache = kv.clone()
    for seq_len in (300, 9, 511, 17):  # 3, 1, 4 and 1 of the 128-token splits hold tokens
        inputs = step_inputs(seq_len)
        for name, t in inputs.items():
            static[name].copy_(t)
        graph.replay()
        want = run(inputs, eager_cache)
        torch.cuda.synchronize()
        assert torch.equal(graph_out[0], want[0]) and torch.equal(graph_out[1], want[1]), seq_len
        assert torch.equal(graph_cache, eager_cache), seq_len

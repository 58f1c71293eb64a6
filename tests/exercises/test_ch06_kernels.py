"""Chapter 06 exercises: Triton kernels, run by Triton's interpreter on the CPU.

- `ch06-fused-add-rms-norm`: the body of `_fused_add_rms_norm_kernel` (one row per program).
- `ch06-reshape-and-cache-kernel`: the body of `_reshape_and_cache_kernel` (one token per program).
- `ch06-decode-online-softmax`: `_decode_tile`, the online-softmax update of one tile of
  paged decode attention; `_decode_partial_kernel` loads the tiles and calls it.
- `ch06-skinny-gemm`: the body of `_skinny_gemm_kernel` (a few tokens times a weight).
- `ch06-gumbel-max`: `_fold_tile`, one lane group of the one-pass sampler: its scores and the
  running best; `_gumbel_sample_kernel` draws the uniforms and calls it. Logit rows are
  followed by +inf guard columns, so an unmasked load wins and is seen.

Every size is chosen to be awkward: rows whose width is not a power of two (so the last
lanes of a block must be masked), K/V rows of 60 elements in a 64-lane block, contexts
shorter than one tile, exactly one tile, and several tiles with a partial last one, GQA
groups of 3, 4 and 8 query heads per KV head. Memory a kernel must not touch is filled with
NaN (guard columns beside each row, cache slots nobody owns), so a load without its mask
poisons the result and a store without its mask is seen.

The RMSNorm tests launch `rms_norm._fused_add_rms_norm_kernel` themselves, the way
`fused_add_rms_norm` does, so that its outputs can have guards too; the others call the
launchers (`cache_kernel.reshape_and_cache`, `paged_attention.paged_decode_attention`), which
find the kernels by their global names at call time. Everything goes through the modules, so
`minivllm exercise check 06` can swap yours in.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import minivllm.kernels.paged_attention as paged_attention
import minivllm.kernels.rms_norm as rms_norm
from minivllm.kernels._utils import next_power_of_2

# Not `import minivllm.kernels.reshape_and_cache as ...`: the package's attribute of that name
# is the launcher function (minivllm/kernels/__init__.py imports it), which hides the module.
cache_kernel = importlib.import_module("minivllm.kernels.reshape_and_cache")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")

# Under the interpreter a store outside a tensor writes straight into the process's memory and
# can crash pytest before any result is reported. So the tests give every kernel memory of its
# own on both sides of what it may touch (NaN "guard" regions), and check that it stayed NaN.


def nan_padded(rows: int, width: int, pad: int, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """A [rows, width] view into a buffer whose `pad` columns right of each row are NaN."""
    buffer = torch.full((rows, width + pad), NAN, dtype=dtype)
    buffer[:, :width] = torch.randn(rows, width, generator=generator).to(dtype)
    return buffer.to(DEVICE)[:, :width]


# -- ch06-fused-add-rms-norm ------------------------------------------------------------------


def run_rms_norm_kernel(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Launch `_fused_add_rms_norm_kernel` as `fused_add_rms_norm` does, into outputs with NaN guards.

    `out` gets guard columns right of each row; the new residual (contiguous rows) gets a
    guard before its first row and after its last. Returns (out, new residual).
    """
    rows, n = x.shape
    block = next_power_of_2(n)
    out_buffer = torch.full((rows, n + block), NAN, dtype=x.dtype, device=DEVICE)
    residual_buffer = torch.full((block + rows * n + block,), NAN, dtype=x.dtype, device=DEVICE)
    out, residual_out = out_buffer[:, :n], residual_buffer[block : block + rows * n].view(rows, n)
    residual_in = x if residual is None else residual
    rms_norm._fused_add_rms_norm_kernel[(rows,)](
        x, residual_in, weight, out, residual_out, x.stride(0), residual_in.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, USE_PDL=False,  # one launch: nothing to overlap
    )
    assert out_buffer[:, n:].isnan().all(), (
        f"the kernel stored past the end of a row of out (lanes {n}..{block - 1} of the block): mask tl.store with offs < N"
    )
    guards = torch.cat([residual_buffer[:block], residual_buffer[block + rows * n :]])
    assert guards.isnan().all(), "the kernel stored outside the new residual's rows: mask tl.store with offs < N"
    if residual is None:
        assert residual_out.isnan().all(), "with HAS_RESIDUAL False the kernel must not store a residual"
    return out, residual_out


def rms_norm_expected(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)


def assert_no_nan_read(t: torch.Tensor, what: str) -> None:
    assert torch.isfinite(t).all(), (
        f"{what} holds NaN: the kernel read lanes past the end of the row (the guard columns are NaN); "
        "mask every tl.load with `offs < N` (and give it other=0.0)"
    )


@pytest.mark.exercise("ch06-fused-add-rms-norm")
@pytest.mark.parametrize(
    ("rows", "hidden", "dtype"),
    [
        pytest.param(3, 10, torch.float32, id="10-of-16-lanes"),
        pytest.param(5, 100, torch.float32, id="100-of-128-lanes"),
        pytest.param(2, 257, torch.float16, id="257-of-512-lanes-fp16"),
    ],
)
def test_residual_add_then_rms_norm_on_rows_that_do_not_fill_the_block(rows, hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    pad = next_power_of_2(hidden)  # an unmasked load of the whole block reads guard NaNs only
    x, residual = nan_padded(rows, hidden, pad, g, dtype), nan_padded(rows, hidden, pad, g, dtype)
    weight = nan_padded(1, hidden, pad, g, dtype)[0]
    out, new_residual = run_rms_norm_kernel(x, residual, weight, 1e-6)
    assert_no_nan_read(new_residual, "the new residual")
    want_residual = (x.float() + residual.float()).to(dtype)
    assert torch.equal(new_residual, want_residual), (
        "row r of the new residual (at residual_out_ptr + r * N) is x + residual, added in float32 and "
        "rounded to the input dtype"
    )
    assert_no_nan_read(out, "the output")
    want = rms_norm_expected(want_residual, weight, 1e-6)
    err = ((out.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # float16: a rounding of the last bit
    assert err < tol, (
        f"out differs from h / sqrt(mean(h²) + eps) * weight by up to {err:.3g}, with h = x + residual: "
        "normalize the sum, in float32, divide the sum of squares by N (not BLOCK), and store row r at "
        "out_ptr + r * out_stride"
    )


@pytest.mark.exercise("ch06-fused-add-rms-norm")
def test_without_a_residual_the_row_is_only_normalized():
    g = torch.Generator().manual_seed(0)
    x = nan_padded(4, 50, 64, g)
    weight = nan_padded(1, 50, 64, g)[0]
    out, _ = run_rms_norm_kernel(x, None, weight, 1e-5)
    assert_no_nan_read(out, "the output")
    err = (out - rms_norm_expected(x, weight, 1e-5)).abs().max().item()
    assert err < 1e-5, f"with HAS_RESIDUAL False, out = x / sqrt(mean(x²) + eps) * weight; off by up to {err:.3g}"


# -- ch06-reshape-and-cache-kernel ------------------------------------------------------------


def guarded_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """(buffer, cache): a NaN cache [2, num_blocks, ...] with one NaN guard block before and after each half."""
    buffer = torch.full((2, num_blocks + 2, block_size, num_kv_heads, head_dim), NAN, device=DEVICE)
    return buffer, buffer[:, 1:-1]


def assert_guards_untouched(buffer: torch.Tensor) -> None:
    assert buffer[:, 0].isnan().all() and buffer[:, -1].isnan().all(), (
        "the kernel wrote outside the cache: a token whose slot is negative is padding and must write "
        "nothing (test `slot >= 0`), and stores must be masked with offsets < ROW"
    )


def fused_kv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """key and value as the model hands them over: views into one qkv tensor (rows not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    # One spare head at the end, so that reading past the last value row stays inside the tensor.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads + 1, head_dim, generator=g).to(DEVICE)
    return qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads : num_heads + 2 * num_kv_heads]


@pytest.mark.exercise("ch06-reshape-and-cache-kernel")
def test_each_token_lands_in_its_slot_and_no_other_slot_changes():
    # 3 KV heads of 20: a token's K row has 60 elements, a 64-lane block with 4 lanes masked.
    num_blocks, block_size, num_kv_heads, head_dim = 6, 5, 3, 20
    buffer, cache = guarded_cache(num_blocks, block_size, num_kv_heads, head_dim)
    slots = [17, 0, 9, 29, 4, 5, 13, 22]  # out of order, across blocks, the first and last slot of the cache
    key, value = fused_kv(len(slots), 6, num_kv_heads, head_dim, seed=2)
    cache_kernel.reshape_and_cache(key, value, cache, torch.tensor(slots, device=DEVICE))
    assert_guards_untouched(buffer)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    untouched = cache.flatten(1, 2)[:, ~written.to(DEVICE)]
    assert untouched.isnan().all(), (
        "a slot that is not in slot_mapping changed: mask the stores with offsets < ROW, so that "
        "the lanes past a token's ROW elements do not spill into the next slot"
    )
    for t, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        assert torch.equal(cache[0, block, offset], key[t]), (
            f"slot {slot} (block {block}, offset {offset}) should hold token {t}'s key: store it at "
            "cache_ptr + slot * ROW, read from key_ptr + t * key_stride (key is a view into qkv: its rows are "
            "key_stride apart, not ROW)"
        )
        assert torch.equal(cache[1, block, offset], value[t]), (
            f"slot {slot} of the V half (cache_kv_stride elements after the K half) should hold token {t}'s value"
        )


@pytest.mark.exercise("ch06-reshape-and-cache-kernel")
def test_a_padding_token_with_slot_minus_one_writes_nothing():
    # CUDA graphs run padded batches: the padding tokens have slot -1 and must not be written.
    buffer, cache = guarded_cache(2, 4, 1, 16)
    key, value = fused_kv(4, 2, 1, 16, seed=3)
    cache_kernel.reshape_and_cache(key, value, cache, torch.tensor([-1, 6, -1, -1], device=DEVICE))
    assert_guards_untouched(buffer)
    assert torch.equal(cache[0, 1, 2], key[1]) and torch.equal(cache[1, 1, 2], value[1]), "token 1 belongs at slot 6"
    assert cache.isnan().sum() == cache.numel() - 2 * 16, "tokens whose slot is negative must write nothing"


# -- ch06-decode-online-softmax ---------------------------------------------------------------


def decode_problem(seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype, seed: int):
    """Contiguous K/V per request, the same K/V scattered over a paged cache whose unowned slots are NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)  # padded with block 0
    contexts = []
    for i, (n, num_blocks_i) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = [order.pop() for _ in range(num_blocks_i)]
        block_tables[i, :num_blocks_i] = torch.tensor(table, dtype=torch.int32)
        kv = torch.randn(2, n, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(n):
            cache[:, table[p // block_size], p % block_size] = kv[:, p]
        contexts.append(kv)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return query.to(DEVICE), cache.to(DEVICE), block_tables.to(DEVICE), seq_lens_t.to(DEVICE), contexts


def softmax_attention(query: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode query [H, D] against its whole context kv [2, n, H_kv, D], in float64."""
    group = query.shape[0] // kv.shape[2]
    key, value = (t.double().repeat_interleave(group, dim=1) for t in kv)  # [n, H, D]
    weights = (torch.einsum("hd,nhd->hn", query.double(), key) * scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", weights, value)


@pytest.mark.exercise("ch06-decode-online-softmax")
@pytest.mark.parametrize(
    ("seq_lens", "num_kv_heads", "group", "num_splits", "dtype", "advice"),
    [
        pytest.param([5, 11], 2, 4, 1, torch.float32,
                     "every context is shorter than one 16-token tile: tokens where n_mask is False must get "
                     "score -inf (weight 0)", id="shorter-than-a-tile"),
        pytest.param([16, 32], 1, 8, 1, torch.float32,
                     "the contexts are whole tiles, 8 query heads share the KV head: check s = q·kᵀ * scale, "
                     "p = exp2(s - m_new), l_i += Σp, acc += p·v", id="whole-tiles"),
        pytest.param([37, 70, 3], 2, 3, 1, torch.float32,
                     "these contexts span several tiles: when the max grows, the old acc and l_i must be "
                     "multiplied by exp2(m_i - m_new) before the tile's terms are added", id="several-tiles"),
        pytest.param([91, 50], 2, 4, 3, torch.float32,
                     "the context is split in 3 and the splits are merged with their (m_i, l_i): return the "
                     "running max as m_i and Σ exp2(s - m_i) as l_i, acc not divided by l_i", id="split-k"),
        pytest.param([29, 40], 2, 2, 2, torch.float16,
                     "half precision: cast p to v's dtype before tl.dot(p, v); acc, m_i and l_i stay float32",
                     id="fp16"),
    ],
)
def test_paged_decode_attention_equals_softmax_attention(seq_lens, num_kv_heads, group, num_splits, dtype, advice):
    head_dim, block_size, tile = 24, 8, 16  # head_dim 24 of a 32-lane block; two cache blocks per tile
    query, cache, block_tables, seq_lens_t, contexts = decode_problem(
        seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=sum(seq_lens)
    )
    scale = head_dim**-0.5
    out = paged_attention.paged_decode_attention(
        query, cache, block_tables, seq_lens_t, scale, num_splits=num_splits, block_n=tile
    )
    assert out.shape == query.shape
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for i, n in enumerate(seq_lens):
        want = softmax_attention(query[i].cpu(), contexts[i], scale)
        got = out[i].cpu().double()
        assert torch.isfinite(got).all(), (
            f"request {i} (context {n}): the output holds NaN or inf. The state starts as m_i = -inf, l_i = 0, "
            "acc = 0: return the new maximum as m_i, and never compute -inf - (-inf) or 0 * inf"
        )
        err = (got - want).abs().max().item()
        assert err < tol, f"request {i} (context {n} tokens): off by up to {err:.3g} from softmax attention; {advice}"


# -- ch06-skinny-gemm -------------------------------------------------------------------------

gemm = importlib.import_module("minivllm.kernels.gemm")


def run_skinny_gemm_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           block_n: int, block_k: int, sum_each_slice: bool) -> torch.Tensor:
    """Launch `_skinny_gemm_kernel` as `skinny_gemm` does, into an output with NaN guards.

    The output's rows are `n + block_n` apart (guard columns right of each row), and `block_m`
    guard rows follow the M real ones: a store outside [M, N] lands on a guard and is seen.
    """
    m, k = x.shape
    n = weight.shape[0]
    block_m = next_power_of_2(m)
    out_buffer = torch.full((m + block_m, n + block_n), NAN, dtype=x.dtype, device=DEVICE)
    out = out_buffer[:m, :n]
    gemm._skinny_gemm_kernel[(-(-n // block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), out.stride(0),
        weight, x, x, 0.0,  # the norm's pointers and eps, unused without NORM
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUM_EACH_SLICE=sum_each_slice,
        USE_PDL=False, GATED=False,  # one launch: nothing to overlap; no SiLU-and-mul before the product
        NORM=False, HAS_RESIDUAL=False, NORM_WEIGHT_AHEAD=False,  # no RMSNorm inside the product
    )
    outside = torch.ones_like(out_buffer, dtype=torch.bool)
    outside[:m, :n] = False
    assert out_buffer[outside].isnan().all(), (
        "the kernel stored outside out's M rows and N columns: mask tl.store with m < M and n < N"
    )
    return out


def skinny_problem(m: int, n: int, k: int, block_k: int, seed: int, dtype=torch.float32):
    """x [m, k] whose rows have NaN guard columns and are followed by NaN rows (up to the next
    power of two), and a contiguous weight [n, k] followed by NaN rows: every lane a kernel must
    mask reads NaN if it does not."""
    g = torch.Generator().manual_seed(seed)
    block_m = next_power_of_2(m)
    x_buffer = torch.full((block_m, k + block_k), NAN, dtype=dtype)
    x_buffer[:m, :k] = torch.randn(m, k, generator=g).to(dtype)
    w_buffer = torch.full(((n + 64) * k,), NAN, dtype=dtype)
    w_buffer[: n * k] = torch.randn(n * k, generator=g).to(dtype) * k**-0.5
    bias = torch.randn(n, generator=g).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(x_buffer)[:m, :k], to(w_buffer)[: n * k].view(n, k), to(bias)


@pytest.mark.exercise("ch06-skinny-gemm")
@pytest.mark.parametrize(
    ("m", "n", "k", "block_n", "block_k", "advice"),
    [
        pytest.param(1, 16, 64, 4, 32, "one token, whole tiles: out[0, n] = Σ_k x[0, k] * weight[n, k]",
                     id="one-token-whole-tiles"),
        pytest.param(3, 10, 50, 4, 32, "3 tokens of a 4-row block, 10 rows of 4-row tiles, K = 50 in 32-wide "
                     "slices: mask rows m >= M, rows n >= N and lanes k >= K when loading", id="partial-everything"),
        pytest.param(5, 7, 100, 8, 64, "5 tokens of an 8-row block and one program for all 7 rows: the x row "
                     "of token m starts at x_ptr + m * x_stride", id="five-tokens-one-program"),
    ],
)
@pytest.mark.parametrize("sum_each_slice", [False, True], ids=["sum-once", "sum-each-slice"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_skinny_gemm_is_x_times_weight_transposed(m, n, k, block_n, block_k, advice, sum_each_slice, with_bias):
    x, weight, bias = skinny_problem(m, n, k, block_k, seed=m * 100 + n)
    out = run_skinny_gemm_kernel(x, weight, bias if with_bias else None, block_n, block_k, sum_each_slice)
    assert torch.isfinite(out).all(), (
        "the output holds NaN: the kernel read a masked lane (x's guard columns and rows and the rows after "
        "weight are NaN); mask every tl.load and give it other=0.0"
    )
    want = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    err = (out.double() - want).abs().max().item()
    # float32 throughout; only the order of the additions differs from the reference's (~1e-6).
    assert err < 1e-4, (
        f"out differs from x @ weight.T{' + bias' if with_bias else ''} by up to {err:.3g}: {advice}"
        + ("; add bias[n] once, after the sum over k" if with_bias else "")
    )


# -- ch06-gumbel-max --------------------------------------------------------------------------

sampling = importlib.import_module("minivllm.kernels.sampling")
INF = float("inf")


def guarded_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[num_rows, vocab_size] logits whose rows are followed by +inf guard columns: a lane past
    the end of the vocabulary that is loaded unmasked scores +inf and wins, which is seen."""
    g = torch.Generator().manual_seed(seed)
    buffer = torch.full((num_rows, vocab_size + 2 * sampling.GUMBEL_SUB), INF)
    buffer[:, :vocab_size] = torch.randn(num_rows, vocab_size, generator=g) * 2
    return buffer.to(DEVICE)[:, :vocab_size]


@pytest.mark.exercise("ch06-gumbel-max")
@pytest.mark.parametrize(("vocab_size", "advice"), [
    pytest.param(700, "one tile, most of it past the end: mask the load with tokens < vocab_size, other=-inf",
                 id="one-partial-tile"),
    pytest.param(5000, "three tiles, the last one partial: each call folds one lane group into the running best",
                 id="several-tiles"),
])
def test_gumbel_max_tile_draws_the_reference_token(vocab_size, advice):
    logits = guarded_logits(4, vocab_size, seed=vocab_size)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0], device=DEVICE)  # row 0 greedy
    out = sampling.gumbel_sample(logits, temperature, seed=123)
    assert (out < vocab_size).all(), f"a token past the vocabulary won ({out.tolist()}): {advice}"
    assert out[0] == logits[0].argmax(), (
        "a greedy row (greedy=True) must score the plain logits, no noise: its token is the argmax"
    )
    want = sampling.gumbel_sample_reference(logits, temperature, seed=123)
    # Rows whose best two scores lie within float rounding may go either way (the kernel's log
    # and PyTorch's can round differently); the seeds here leave every row decided.
    scores = sampling.gumbel_max_scores(logits, temperature, sampling.gumbel_uniforms(4, vocab_size, 123, logits.device))
    top2 = scores.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs().clamp_min(1.0)).all(), "premise: no near-tie"
    assert torch.equal(out, want), (
        f"tokens {out.tolist()}, reference {want.tolist()}: score = logit * inv_temperature - log(-log(u)), "
        "and keep the new score and token only where score > best"
    )


@pytest.mark.exercise("ch06-gumbel-max")
def test_gumbel_max_tile_never_draws_a_masked_token():
    logits = guarded_logits(3, 3000, seed=1)
    logits[:, :] = -INF
    allowed = torch.tensor([5, 1999, 2999], device=DEVICE)
    logits[:, allowed] = torch.tensor([0.0, 0.3, -0.2], device=DEVICE)
    for seed in range(4):
        out = sampling.gumbel_sample(logits, torch.ones(3, device=DEVICE), seed=seed)
        assert torch.isin(out, allowed).all(), (
            f"seed {seed}: drew {out.tolist()}, but only {allowed.tolist()} have finite logits; a logit of -inf "
            "plus any noise is -inf and must never replace a finite best"
        )

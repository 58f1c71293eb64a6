"""Sampling in one pass over the logits, in Triton: the Gumbel-max trick (chapter 06).

The sampler's PyTorch path takes a batch of logits through temperature, softmax and the
exponential race (`sample_exponential_race`), each a pass over [B, V] float32 values: at 256
rows of a 128k-token vocabulary that is about eight passes of 131 MB a step. The same draw
needs one read of the logits:

    argmax_v  p_v / E_v  =  argmax_v  (log p_v - log E_v)  =  argmax_v  (logits_v / T + G_v)

with E_v ~ Exp(1), so G_v = -log E_v = -log(-log U_v) ~ Gumbel(0, 1) for U_v uniform in
(0, 1). `log p_v` is `logits_v / T` minus the row's log-sum-exp, the same for every token of
the row, so it drops out of the argmax: no softmax, no normalization, no second pass.

A program walks a row in tiles of 4 x SUB tokens. Triton's Philox generator is
counter-based: `tl.rand4x(seed, counter)` gives four uniforms per counter, a pure function of
(seed, counter), so each (row, tile, lane) gets its own counter and every token its own
uniform, with no state between steps but the seed the caller draws. Each lane keeps its best
score and token so far; at the end the best lane wins (the lowest token id among exact
ties). A greedy row (temperature below 1e-5, as `SamplingParams` counts it) adds no noise:
its plain argmax. With few rows, each row is cut into splits of whole tiles, one program
each, and a merge kernel takes each row's best split: one row of a 128k vocabulary would
otherwise be a single program doing all the work while the rest of the GPU idles.

The reference computes the same scores in PyTorch from the same uniforms, which
`gumbel_uniforms` writes out with the kernel's own counter layout; chapter 06's test also
checks the kernel's draws against softmax(logits / T) directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2
from minivllm.sampling_params import _GREEDY_TEMPERATURE as GREEDY_TEMPERATURE  # SamplingParams' cut-off

GUMBEL_SUB = 512  # tokens per lane group; a tile is 4 groups (one Philox call gives 4 uniforms)


def gumbel_sample_reference(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """The same draw in PyTorch, from the same uniforms as the kernel."""
    return gumbel_max(logits, temperature, gumbel_uniforms(logits.shape[0], logits.shape[1], seed, logits.device))


# --8<-- [start:gumbel-max]
def gumbel_max(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T - log(-log U)) per row, for uniforms U of the same shape; greedy rows
    (T < 1e-5) take argmax(logits). With U uniform, a row's token follows softmax(logits / T)."""
    return gumbel_max_scores(logits, temperature, uniforms).argmax(dim=-1)


def gumbel_max_scores(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Every token's score: logits / T plus Gumbel noise, or the logit itself in a greedy row."""
    greedy = temperature < GREEDY_TEMPERATURE
    # x * (1 / T), as the kernel computes it, so both round alike.
    scaled = logits.float() * (1.0 / torch.where(greedy, 1.0, temperature)).unsqueeze(-1)
    return torch.where(greedy.unsqueeze(-1), logits.float(), scaled - torch.log(-torch.log(uniforms)))
# --8<-- [end:gumbel-max]


# --8<-- [start:gumbel-kernel]
# exercise[ch06-gumbel-max]: load the group's logits (masked: -inf past vocab_size) in fp32; score = x (greedy) or x * inv_temperature - log(-log u); keep score and token where score > best
@triton.jit
def _fold_tile(best, best_token, row_logits, tokens, uniforms, vocab_size, inv_temperature, greedy):
    """Score one group of tokens and keep, per lane, the best score and its token so far.

    `tokens` [SUB] int32 are the group's token ids, one per lane (ids from `vocab_size` on are
    past the end of the row: they must not be loaded, and must never win); `row_logits` points
    at the row's first logit; `uniforms` [SUB] are the lanes' uniforms in (0, 1). A token's
    score is its logit (float32) when the row is greedy (`greedy`, a scalar bool), else
    logit * inv_temperature plus Gumbel noise -log(-log u). `best` [SUB] float32 and
    `best_token` [SUB] int32 are each lane's best score and its token so far: replace them
    only where the new score is strictly greater, so that a tie keeps the lower token id.
    Returns the new (best, best_token).
    """
    x = tl.load(row_logits + tokens, mask=tokens < vocab_size, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(uniforms))  # a uniform of exactly 0 gives -inf: never chosen
    score = tl.where(greedy, x, x * inv_temperature + gumbel)
    better = score > best  # strict: an earlier (lower) token id keeps a tie
    return tl.where(better, score, best), tl.where(better, tokens, best_token)


# The seed changes every step and the split length with the batch: left unspecialized,
# neither causes a recompile.
# NOISE=False is the greedy batch: every row takes its argmax, and no noise is drawn.
@triton.jit(do_not_specialize=["seed", "tiles_per_split"])
def _gumbel_sample_kernel(
    logits_ptr, logits_stride, temperature_ptr, out_ptr, part_score_ptr, part_token_ptr,
    seed, vocab_size, num_tiles, tiles_per_split,
    SUB: tl.constexpr, ONE_SPLIT: tl.constexpr, NOISE: tl.constexpr = True,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if NOISE:
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature < 1e-5  # GREEDY_TEMPERATURE
        inv_temperature = tl.div_rn(1.0, tl.where(greedy, 1.0, temperature))
    else:
        greedy = True
        inv_temperature = 1.0
    row_logits = logits_ptr + row.to(tl.int64) * logits_stride
    lanes = tl.arange(0, SUB)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_token = tl.zeros([SUB], tl.int32)
    first_tile = split * tiles_per_split
    for tile in range(first_tile, tl.minimum(first_tile + tiles_per_split, num_tiles)):
        if NOISE:
            # The counter names (row, tile, lane), not the split: the noise is the same
            # however the row is split.
            u0, u1, u2, u3 = tl.rand4x(seed, (row * num_tiles + tile) * SUB + lanes)
        else:  # unused by a greedy row's score
            u0 = tl.full([SUB], 0.5, tl.float32)
            u1 = u0
            u2 = u0
            u3 = u0
        base = tile * 4 * SUB + lanes
        best, best_token = _fold_tile(best, best_token, row_logits, base, u0, vocab_size, inv_temperature, greedy)
        best, best_token = _fold_tile(best, best_token, row_logits, base + SUB, u1, vocab_size, inv_temperature, greedy)
        best, best_token = _fold_tile(best, best_token, row_logits, base + 2 * SUB, u2, vocab_size, inv_temperature, greedy)
        best, best_token = _fold_tile(best, best_token, row_logits, base + 3 * SUB, u3, vocab_size, inv_temperature, greedy)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_token, vocab_size), axis=0)
    if ONE_SPLIT:
        tl.store(out_ptr + row, token.to(tl.int64))
    else:  # this split's best, for the merge
        tl.store(part_score_ptr + row * tl.num_programs(1) + split, top)
        tl.store(part_token_ptr + row * tl.num_programs(1) + split, token)


@triton.jit(do_not_specialize=["num_splits"])
def _gumbel_merge_kernel(part_score_ptr, part_token_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    """Each row's best split wins; among exact ties the lowest token (splits are in token order)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_splits
    score = tl.load(part_score_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    token = tl.load(part_token_ptr + row * num_splits + offs, mask=mask, other=2**31 - 1)
    top = tl.max(score, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (score == top), token, 2**31 - 1), axis=0).to(tl.int64))
# --8<-- [end:gumbel-kernel]


@triton.jit(do_not_specialize=["seed"])
def _uniforms_kernel(out_ptr, seed, vocab_size, num_tiles, SUB: tl.constexpr):
    """The kernel's uniforms, written at [row, token]: the reference's noise."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    lanes = tl.arange(0, SUB)
    u0, u1, u2, u3 = tl.rand4x(seed, (row * num_tiles + tile) * SUB + lanes)
    row_out = out_ptr + row.to(tl.int64) * vocab_size
    base = tile * 4 * SUB + lanes
    tl.store(row_out + base, u0, mask=base < vocab_size)
    tl.store(row_out + base + SUB, u1, mask=base + SUB < vocab_size)
    tl.store(row_out + base + 2 * SUB, u2, mask=base + 2 * SUB < vocab_size)
    tl.store(row_out + base + 3 * SUB, u3, mask=base + 3 * SUB < vocab_size)


def fits_one_launch(num_rows: int, vocab_size: int, sub: int = GUMBEL_SUB) -> bool:
    """Do the noise counters of [num_rows, vocab_size] logits fit Philox's 32 bits?"""
    return num_rows * triton.cdiv(vocab_size, 4 * sub) * sub < 2**31


def _num_tiles(num_rows: int, vocab_size: int, sub: int = GUMBEL_SUB) -> int:
    num_tiles = triton.cdiv(vocab_size, 4 * sub)
    if not fits_one_launch(num_rows, vocab_size, sub):
        raise ValueError(f"gumbel_sample: {num_rows} rows x {vocab_size} tokens is too large for one launch")
    return num_tiles


def gumbel_uniforms(num_rows: int, vocab_size: int, seed: int, device: torch.device, sub: int = GUMBEL_SUB) -> torch.Tensor:
    """[num_rows, vocab_size] float32: the uniform that `gumbel_sample(..., seed, sub=sub)` draws for each token."""
    num_tiles = _num_tiles(num_rows, vocab_size, sub)
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    if num_rows:
        _uniforms_kernel[(num_rows, num_tiles)](out, seed, vocab_size, num_tiles, SUB=sub)
    return out


# --8<-- [start:gumbel-launcher]
def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: int,
    num_splits: int | None = None, num_warps: int = 4, sub: int = GUMBEL_SUB, noise: bool = True,
) -> torch.Tensor:
    """One token per row of `logits` [B, V] (any float dtype, unit stride along V), drawn from
    softmax(logits / temperature) (float32 [B]; rows below 1e-5 take the argmax); int64 [B].

    `seed` (0 <= seed < 2**31) keys the noise: the same seed and logits give the same tokens,
    whatever `num_splits`. A few rows are each cut into splits so that enough programs run
    (a lone row would otherwise be one program walking the whole vocabulary); a merge
    kernel then picks each row's best split. `noise=False` (`argmax_sample`): every row's
    argmax, `temperature` unread.
    """
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("gumbel_sample needs unit stride along the vocabulary")
    if not 0 <= seed < 2**31:
        raise ValueError(f"gumbel_sample: seed must be in [0, 2**31), got {seed}")
    num_tiles = _num_tiles(num_rows, vocab_size, sub)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not num_rows:
        return out
    if num_splits is None:
        num_splits = gumbel_num_splits(num_rows, num_tiles, logits.device)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    one_split = num_splits == 1
    parts = 1 if one_split else num_rows * num_splits  # with one split the partial buffers stay unused
    part_score = torch.empty(parts, dtype=torch.float32, device=logits.device)
    part_token = torch.empty(parts, dtype=torch.int32, device=logits.device)
    _gumbel_sample_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), temperature, out, part_score, part_token, seed, vocab_size, num_tiles, tiles_per_split,
        SUB=sub, ONE_SPLIT=one_split, NOISE=noise, num_warps=num_warps,
    )
    if not one_split:
        # One merge variant per vocabulary: its split tile covers the most splits there can be.
        _gumbel_merge_kernel[(num_rows,)](part_score, part_token, out, num_splits,
                                          BLOCK_S=max(16, next_power_of_2(num_tiles)))
    return out
# --8<-- [end:gumbel-launcher]


# --8<-- [start:greedy-launcher]
def argmax_sample(logits: torch.Tensor, num_splits: int | None = None, num_warps: int = 4,
                  sub: int = GUMBEL_SUB) -> torch.Tensor:
    """Each row's argmax (the lowest token among exact ties), int64 [B]: a greedy batch
    through the same kernel with its noise off. A few rows are cut into splits as above, so a
    batch of one reads its logits with the whole GPU; and the logits are read in their own
    dtype, with no float32 copy."""
    return gumbel_sample(logits, logits, 0, num_splits=num_splits, num_warps=num_warps, sub=sub, noise=False)


def argmax_sample_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)
# --8<-- [end:greedy-launcher]


def gumbel_num_splits(num_rows: int, num_tiles: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Splits per row: enough programs to fill every SM a few times over, at most one a tile."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(num_tiles, triton.cdiv(programs_per_sm * num_sms, num_rows)))

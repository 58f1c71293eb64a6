"""Chapter 11 exercise: applying a grammar's token bitmask to the logits before sampling.

A bitmask row holds one bit per token, packed 32 to an int32 word: token t is allowed when bit
`t % 32` of word `t // 32` is set. Masked tokens get logit -inf, so no sampling method can pick
them. The function is called through its module (`bitmask.apply_token_bitmask`), as the model
runner's hook calls it; xgrammar's own `apply_token_bitmask_inplace` is the outside reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.structured_output import bitmask as bitmask_module

NEG_INF = float("-inf")


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool → [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32 (test helper)."""
    rows, vocab = allowed.shape
    num_words = (vocab + 31) // 32
    padded = torch.zeros(rows, num_words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (padded.view(rows, num_words, 32) * weights).sum(-1)
    # Words with bit 31 set are negative as int32: wrap the unsigned value into range.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.exercise("ch11-apply-bitmask")
def test_one_row_keeps_exactly_the_allowed_tokens():
    logits = torch.arange(40, dtype=torch.float32).unsqueeze(0)
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, [0, 5, 31, 32, 39]] = True  # 31 and 32: the last bit of word 0, the first of word 1
    bitmask_module.apply_token_bitmask(logits, pack_allowed(allowed))
    kept = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert kept == [0, 5, 31, 32, 39], f"token t is allowed by bit t % 32 of word t // 32; kept {kept}"
    assert logits[0, 5].item() == 5.0, "an allowed token's logit must be left exactly as it was"


@pytest.mark.exercise("ch11-apply-bitmask")
def test_bit_31_is_a_token_too():
    # Word value -2**31 has only bit 31 set: as int32 it is negative, and ">>" must still find it.
    logits = torch.zeros(1, 32)
    bitmask = torch.tensor([[-(2**31)]], dtype=torch.int32)
    bitmask_module.apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31], "only token 31 is allowed by 0x80000000"


@pytest.mark.exercise("ch11-apply-bitmask")
def test_columns_past_the_bitmask_are_padding_and_masked():
    # A model whose logits are wider than the grammar's vocabulary (a padded embedding): 70
    # logits, a bitmask of 2 words (64 tokens) that allows everything it covers.
    logits = torch.randn(3, 70)
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    original = logits.clone()
    bitmask_module.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits[:, :64], original[:, :64]), "every covered token is allowed: nothing may change"
    assert torch.all(logits[:, 64:] == NEG_INF), "logits beyond the bitmask's 64 bits are padding: -inf"


@pytest.mark.exercise("ch11-apply-bitmask")
def test_rows_are_masked_independently():
    logits = torch.zeros(2, 10)
    allowed = torch.zeros(2, 10, dtype=torch.bool)
    allowed[0, 3] = True
    allowed[1, 7] = True
    bitmask_module.apply_token_bitmask(logits, pack_allowed(allowed))
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 3], [1, 7]], "row r of the bitmask masks row r of the logits"


@pytest.mark.exercise("ch11-apply-bitmask")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), extra_columns=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_agrees_with_xgrammar(rows, vocab, extra_columns, seed):
    xgr = pytest.importorskip("xgrammar")
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < 0.3
    bitmask = pack_allowed(allowed)
    logits = torch.randn(rows, vocab + extra_columns, generator=generator)
    expected = logits.clone()
    # xgrammar masks the first `vocab` columns; the padding beyond them we mask ourselves.
    # Its torch backend is the reference: in xgrammar 0.2.9 the C++ CPU kernel misreads a
    # one-word bitmask ([rows, 1], vocab <= 32) for rows after the first.
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, backend="torch_native")
    expected[:, vocab:] = NEG_INF
    # Our bitmask covers ceil(vocab / 32) * 32 tokens; bits past `vocab` are zero (disallowed).
    bitmask_module.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected), "the masked logits differ from xgrammar's apply_token_bitmask_inplace"

"""Applying a grammar's token bitmask to the logits, before sampling (chapter 11).

A bitmask row packs one bit per token into int32 words: token t is allowed when bit `t % 32`
of word `t // 32` is set (xgrammar's layout, which vLLM uses as well). Masking a token means
setting its logit to -inf, so that softmax gives it probability 0 and argmax never picks it;
every sampling method then chooses among the allowed tokens only.

This module needs only torch: the model runner imports it whether or not xgrammar is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minivllm.scheduler.output import SchedulerOutput

BITS_PER_WORD = 32


# --8<-- [start:apply-token-bitmask]
# exercise[ch11-apply-bitmask]: unpack bit t % 32 of word t // 32 (shift and & 1); tokens whose bit is 0, or past the mask's width, get -inf
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    `logits` is [num_rows, vocab_size] (float); `bitmask` is [num_rows, num_words] int32 on the
    same device, one row per logits row. Token t of a row is allowed when bit `t % 32` of
    word `t // 32` is 1 (bit 0 is the least significant). Logits columns beyond
    `num_words * 32` have no bit at all: they are padding of the vocabulary, never allowed.
    Allowed logits are left exactly as they were.
    """
    vocab_size = logits.shape[-1]
    bit_positions = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    # [rows, words, 32]: bit b of each word; ">>" is arithmetic for int32, so "& 1" keeps one bit.
    bits = (bitmask.unsqueeze(-1) >> bit_positions) & 1
    allowed = bits.flatten(start_dim=1).bool()[:, :vocab_size]
    logits[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
    logits[:, allowed.shape[1] :] = float("-inf")
# --8<-- [end:apply-token-bitmask]


# --8<-- [start:apply-grammar-bitmask]
def apply_grammar_bitmask(
    logits: torch.Tensor, sampled_req_ids: list[str], scheduler_output: SchedulerOutput
) -> torch.Tensor:
    """The model runner's hook: mask the logits rows of this step's structured requests.

    `logits` row i belongs to `sampled_req_ids[i]`. The scheduler output's bitmask has one row
    per structured request (`structured_output_request_ids`: request id → bitmask row); the
    other rows, unconstrained requests in the same batch, are left untouched.
    """
    row_of = scheduler_output.structured_output_request_ids
    if scheduler_output.grammar_bitmask is None or not row_of:
        return logits
    logits_rows = [i for i, req_id in enumerate(sampled_req_ids) if req_id in row_of]
    if not logits_rows:
        return logits
    mask_rows = [row_of[sampled_req_ids[i]] for i in logits_rows]
    bitmask = scheduler_output.grammar_bitmask[mask_rows].to(logits.device, non_blocking=True)
    index = torch.tensor(logits_rows, device=logits.device)
    constrained = logits.index_select(0, index)
    apply_token_bitmask(constrained, bitmask)
    logits.index_copy_(0, index, constrained)
    return logits
# --8<-- [end:apply-grammar-bitmask]

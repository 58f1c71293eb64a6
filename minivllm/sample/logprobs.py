"""Turn one row of the sampler's logprob tensors into vLLM's per-position logprobs dict.

Chapter 02 (output processing) uses this: the sampler returns, for every row, the sampled
token in column 0 and the batch's top-N tokens in columns 1..N (see `SamplerOutput`); the
output processor keeps the first `num_logprobs` of those N for each request and builds
`{token_id: Logprob(logprob, rank, decoded_token)}`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minivllm.outputs import Logprob


def make_logprobs_dicts(
    token_ids_row: Sequence[int] | torch.Tensor,
    logprobs_row: Sequence[float] | torch.Tensor,
    sampled_rank: int,
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """The logprobs dict of one generated position, in vLLM's format.

    The sampled token comes first, with its true rank (which may be anything: a sampled
    token need not be likely). Then the top `num_logprobs` tokens with ranks 1, 2, ... .
    A token that is both sampled and in the top appears once, as the sampled entry: its
    rank counts only strictly better tokens, so a tie with the top token still says rank 1.
    So the dict has num_logprobs or num_logprobs + 1 entries, as in vLLM.
    """
    if isinstance(token_ids_row, torch.Tensor):
        token_ids_row = token_ids_row.tolist()
    if isinstance(logprobs_row, torch.Tensor):
        logprobs_row = logprobs_row.tolist()
    if num_logprobs > len(token_ids_row) - 1:
        raise ValueError(
            f"asked for {num_logprobs} logprobs but the row holds only "
            f"{len(token_ids_row) - 1} top tokens (was max_num_logprobs set for this batch?)"
        )

    def entry(token_id: int, logprob: float, rank: int) -> Logprob:
        return Logprob(logprob, rank, decode(token_id) if decode is not None else None)

    sampled_id = int(token_ids_row[0])
    result = {sampled_id: entry(sampled_id, float(logprobs_row[0]), int(sampled_rank))}
    for rank in range(1, num_logprobs + 1):
        token_id = int(token_ids_row[rank])
        if token_id not in result:
            result[token_id] = entry(token_id, float(logprobs_row[rank]), rank)
    return result

"""`AttentionMetadata`: the layout of one step's flattened batch, as attention sees it.

The model runner lays every scheduled token of every request end to end in one batch of
`num_actual_tokens` tokens, decode requests first. For request i, its query tokens are
`query_start_loc[i]:query_start_loc[i+1]`, it has `seq_lens[i]` tokens of context once this
step's K/V are written, and `block_tables[i]` lists its KV blocks. `slot_mapping[t]` is where
token t's K/V go: `block_id * block_size + offset`. Chapter 04 draws this picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# --8<-- [start:attention-metadata]
@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32; only the columns of each context are read
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop in Python (the torch reference backend).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from this step's layout once and reuses in every layer (the
    # Triton backend's list of prefill tiles).
    backend_cache: dict = field(default_factory=dict)
# --8<-- [end:attention-metadata]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

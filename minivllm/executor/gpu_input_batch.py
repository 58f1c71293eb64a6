"""`InputBatch`: the model runner's persistent batch, one row per running request.

Most of a step's batch is the previous step's batch: the same requests, one token further.
So, as vLLM's `InputBatch` does, the runner keeps every running request in a row of
preallocated host tensors (its token ids, how many are computed, its block table) and applies
only the scheduler's differences each step: add a row for a new request, free the row of a
finished one, append new block ids, write the token just sampled. Building the step's flat
inputs is then a few vectorized gathers over those rows (`flatten_batch`), written into pinned
host buffers and copied to the device without blocking. Chapter 05 (executor & worker).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner keeps about a request beyond its row: Python-side sampling state."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None


# --8<-- [start:flatten-batch]
# exercise[ch05-flatten-batch]: req_index = repeat(arange, num_scheduled); position = num_computed[req_index] + offset inside the request; slot from block_table[req_index, position // block_size]
def flatten_batch(
    num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray, block_table: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay one step's tokens end to end: each token's request, position and cache slot.

    Request i (row i of the arrays) computes `num_scheduled_tokens[i]` new tokens, at positions
    `num_computed_tokens[i]` onward; `block_table[i]` lists its KV blocks. Returns int64 arrays
    of length `num_scheduled_tokens.sum()`: `req_indices` (which request each token belongs
    to), `positions`, and `slot_mapping` (block_id * block_size + position % block_size).
    The same arithmetic as chapter 04's `compute_slot_mapping`, for all requests at once.
    """
    num_reqs = len(num_scheduled_tokens)
    req_indices = np.repeat(np.arange(num_reqs), num_scheduled_tokens)
    # Offset of each token inside its request's chunk: 0, 1, ... restarting at each request.
    starts = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens
    offsets = np.arange(len(req_indices)) - np.repeat(starts, num_scheduled_tokens)
    positions = num_computed_tokens[req_indices] + offsets
    block_ids = block_table[req_indices, positions // block_size]
    slot_mapping = block_ids.astype(np.int64) * block_size + positions % block_size
    return req_indices.astype(np.int64), positions.astype(np.int64), slot_mapping
# --8<-- [end:flatten-batch]


class InputBatch:
    """Rows of preallocated host tensors, one per running request, updated in place."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # int32 on the host: numpy views of these tensors do the per-step arithmetic.
        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32, pin_memory=pin_memory)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32, pin_memory=pin_memory)
        self.token_ids_np = self.token_ids.numpy()
        self.block_table_np = self.block_table.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + output tokens known
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out row 0 first

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    # -- the scheduler's diffs --------------------------------------------------------------

    def add_request(self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int) -> None:
        if not self._free_rows:
            raise RuntimeError(f"the persistent batch is full ({self.max_num_reqs} rows = max_num_seqs)")
        num_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id} has {num_tokens} tokens, more than max_model_len={self.max_model_len}")
        row = self._free_rows.pop()
        self.req_id_to_row[state.req_id] = row
        self.requests[state.req_id] = state
        num_prompt = len(state.prompt_token_ids)
        self.token_ids_np[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_np[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(state.req_id, block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            del self.requests[req_id]
            self._free_rows.append(row)

    def append_block_ids(self, req_id: str, block_ids: list[int], replace: bool = False) -> None:
        row = self.req_id_to_row[req_id]
        start = 0 if replace else int(self.num_blocks[row])
        self.block_table_np[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Write each request's newly sampled token into its row (each request once): one
        gather and one scatter for the whole step, not a numpy call per request."""
        rows = self.rows_of(req_ids)
        lengths = self.num_tokens[rows]
        room = lengths < self.max_model_len  # a request's last token is never computed
        self.token_ids_np[rows[room], lengths[room]] = np.asarray(token_ids, dtype=np.int32)[room]
        self.num_tokens[rows] = lengths + 1
        for req_id, token_id in zip(req_ids, token_ids):
            self.requests[req_id].output_token_ids.append(token_id)  # the sampler's penalties read it

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

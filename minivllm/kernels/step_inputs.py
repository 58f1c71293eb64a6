"""Unpacking a step's inputs on the device: one kernel for every array (chapter 05).

The host packs a step's small inputs end to end into one int32 buffer behind a header of
(offset, length) pairs (`minivllm/executor/step_inputs.py`), and one copy takes it to the
device. This kernel then writes each array into the buffer the model reads: program (s, b)
handles block b of array s, so every array is written by the same launch. It reads the header
from the device buffer itself, so the launch has no per-step integer argument that Triton
would specialize on (and recompile for). A negative token id -(r + 1) is the previous step's
sampled token r, loaded here; the block tables are written row by row at the device buffer's
stride, only as wide as this step needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.executor.step_inputs import BLOCK_TABLE_WIDTH, NUM_SEGMENTS, unpack_step_inputs_reference

UNPACK_BLOCK = 1024

__all__ = ["unpack_step_inputs", "unpack_step_inputs_reference"]


# --8<-- [start:unpack-kernel]
@triton.jit
def _unpack_step_inputs_kernel(
    staged_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, query_start_loc_ptr, seq_lens_ptr,
    block_tables_ptr, block_table_stride, logits_indices_ptr, last_sampled_ptr,
    WIDTH_WORD: tl.constexpr, BLOCK: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(staged_ptr + 2 * segment)
    length = tl.load(staged_ptr + 2 * segment + 1)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    values = tl.load(staged_ptr + start + offs, mask=mask, other=0)
    # tl.store converts to each buffer's element type (int64 for ids, positions and slots).
    if segment == 0:  # token ids; -(r + 1) is row r of the last step's sampled tokens
        pending = values < 0
        sampled = tl.load(last_sampled_ptr + (-values - 1), mask=mask & pending, other=0)
        tl.store(input_ids_ptr + offs, tl.where(pending, sampled, values.to(tl.int64)), mask=mask)
    elif segment == 1:
        tl.store(positions_ptr + offs, values, mask=mask)
    elif segment == 2:
        tl.store(slot_mapping_ptr + offs, values, mask=mask)
    elif segment == 3:
        tl.store(query_start_loc_ptr + offs, values, mask=mask)
    elif segment == 4:
        tl.store(seq_lens_ptr + offs, values, mask=mask)
    elif segment == 5:  # block tables: `width` columns a row, at the buffer's row stride
        width = tl.maximum(tl.load(staged_ptr + WIDTH_WORD), 1)
        row, col = offs // width, offs % width
        tl.store(block_tables_ptr + row * block_table_stride + col, values, mask=mask)
    else:
        tl.store(logits_indices_ptr + offs, values, mask=mask)
# --8<-- [end:unpack-kernel]


def unpack_step_inputs(
    staged: torch.Tensor, max_length: int, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, logits_indices: torch.Tensor, last_sampled: torch.Tensor,
) -> None:
    """Write each array packed in `staged` into its buffer (see the reference for the layout)."""
    if staged.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("unpack_step_inputs needs an int32 staging buffer and block tables with unit column stride")
    if max_length == 0:
        return
    grid = (NUM_SEGMENTS, triton.cdiv(max_length, UNPACK_BLOCK))
    _unpack_step_inputs_kernel[grid](
        staged, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, block_tables.stride(0),
        logits_indices, last_sampled, WIDTH_WORD=BLOCK_TABLE_WIDTH, BLOCK=UNPACK_BLOCK, num_warps=4,
    )

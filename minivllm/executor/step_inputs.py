"""A step's small inputs in one host-to-device copy (chapter 05).

Every step sends the device a handful of small arrays: the token ids and positions, the slot
mapping, the query start offsets, the sequence lengths, the block tables, and the rows to
sample. Copied one by one, that is a copy each (about a microsecond of the GPU's timeline
apiece at batch 1, in stream order before the forward pass), plus, with async scheduling, a
gather and a scatter for the decodes whose input token the previous step is still sampling.
Here the host writes them end to end into one pinned int32 buffer, behind a small header that
says where each one starts and how long it is; one copy takes the whole buffer to the device,
and one kernel (`minivllm/kernels/step_inputs.py`) writes every array into the device buffers
the model and the CUDA graphs read, widening to int64 where they hold int64.

A decode whose input the last step is still sampling gets -(r + 1) for its token id: row r of
that step's sampled tokens, which the kernel reads on the device. Token ids are never
negative, so the sign is free to carry it, and the scatter needs no index arrays of its own.

A block table travels only as wide as this step's longest context needs: the kernels never
read a row past the blocks of its own context, so the columns beyond stay as they were.

On the CPU the "device" buffers are host tensors: `unpack_step_inputs_reference` copies into
them with plain torch, and is also the kernel's reference.
"""

from __future__ import annotations

import numpy as np
import torch

# The arrays, in the order of the header's (offset, length) pairs. The block tables' length
# is rows * width, with the width in the header's last word.
INPUT_IDS, POSITIONS, SLOT_MAPPING, QUERY_START_LOC, SEQ_LENS, BLOCK_TABLES, LOGITS_INDICES = range(7)
NUM_SEGMENTS = 7
BLOCK_TABLE_WIDTH = 2 * NUM_SEGMENTS  # the header word that holds the block tables' width
HEADER_WORDS = 16  # 15 used; 16 keeps the first array 64-byte aligned
INT32_MAX = 2**31 - 1


# --8<-- [start:unpack-reference]
# exercise[ch05-unpack-step-inputs]: array s is staged[header[2s] : header[2s] + header[2s + 1]]; a token id -(r + 1) becomes last_sampled[r]; the block tables are length // width rows of width = header[BLOCK_TABLE_WIDTH]
def unpack_step_inputs_reference(
    staged: torch.Tensor, max_length: int, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, logits_indices: torch.Tensor, last_sampled: torch.Tensor,
) -> None:
    """Write each array of `staged` (int32: header, then the arrays) into its buffer.

    A negative token id -(r + 1) becomes `last_sampled[r]`. Block-table rows land at the
    buffer's row stride, `width` columns each. `max_length` (the longest array) sizes the
    kernel's grid; here it is not needed.
    """
    header = staged[:HEADER_WORDS].tolist()
    targets = (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices)
    for segment, target in enumerate(targets):
        start, length = header[2 * segment], header[2 * segment + 1]
        values = staged[start : start + length].long()
        if segment == INPUT_IDS:
            pending = values < 0
            values[pending] = last_sampled[-values[pending] - 1].to(values.device)
        if segment == BLOCK_TABLES:
            width = header[BLOCK_TABLE_WIDTH]
            if length:
                target[: length // width, :width] = values.view(-1, width).to(target.dtype)
        else:
            target[:length] = values.to(target.dtype)
# --8<-- [end:unpack-reference]


class StepInputStager:
    """One pinned int32 buffer that a step's inputs are written into, end to end."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        # On the CPU the kernel's reference reads the host buffer itself: nothing to copy.
        self.device_buffer = torch.zeros(capacity, dtype=torch.int32, device=device) if on_cuda else self.host
        self.on_cuda = on_cuda
        self.end = HEADER_WORDS
        self.max_length = 0

    def start(self) -> None:
        """Begin a step: every array empty. The previous step's copy must be done (the caller
        waits for it), since this rewrites the pinned buffer it reads."""
        self.host_np[:HEADER_WORDS] = 0
        self.end = HEADER_WORDS
        self.max_length = 0

    def take(self, segment: int, length: int) -> np.ndarray:
        """The int32 view to write array `segment` into, `length` values long."""
        start = self.end
        if start + length > self.capacity:
            raise RuntimeError(f"step inputs need {start + length} int32 words, the staging buffer has {self.capacity}")
        self.host_np[2 * segment] = start
        self.host_np[2 * segment + 1] = length
        self.end = start + length
        self.max_length = max(self.max_length, length)
        return self.host_np[start : start + length]

    def take_rows(self, segment: int, rows: int, width: int) -> np.ndarray:
        """A [rows, width] int32 view for a two-dimensional array (the block tables)."""
        self.host_np[BLOCK_TABLE_WIDTH] = width
        return self.take(segment, rows * width).reshape(rows, width)

    def upload(self, targets: tuple[torch.Tensor, ...], last_sampled: torch.Tensor | None) -> None:
        """Send what was taken since `start` to the device and unpack it into `targets`
        (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
        logits_indices). `last_sampled`: the previous step's sampled tokens on the device,
        for the negative token ids; None when there are none."""
        if last_sampled is None:
            last_sampled = targets[INPUT_IDS]  # never read: no token id is negative
        if not self.on_cuda:
            unpack_step_inputs_reference(self.host, self.max_length, *targets, last_sampled)
            return
        # Non-blocking from pinned memory; the caller records an event after it and waits on
        # that event before the next `start`.
        self.device_buffer[: self.end].copy_(self.host[: self.end], non_blocking=True)
        from minivllm.kernels import call_kernel  # imported late: importing defines the kernels

        call_kernel("unpack_step_inputs", self.device_buffer, self.max_length, *targets, last_sampled)

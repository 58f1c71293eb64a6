"""Pull weights into the GPU's L2 cache ahead of the kernels that read them (chapter 06, an experiment).

At batch 1 a layer's kernels spend most of their time not reading memory: launching,
waiting for the first bytes, reducing, RMSNorm, RoPE, attention over a short context. The
weights could be streaming from memory during those gaps. This kernel runs on a side stream,
beside the layer's kernels, and brings the coming weights into L2, so that the products
later find them there. Its only effect is on the cache, and so on time.

Three ways to ask, each program covering `bytes_per_program` of the range:

  * "bulk" (Hopper): `cp.async.bulk.prefetch.L2`, one instruction per lane for a whole
    chunk of the range: the copy engine beside the SM (TMA) does the rest;
  * "lines": `prefetch.global.L2`, one instruction per 128-byte line;
  * "loads": ordinary loads, marked to stay in L2 (evict_last), summed into `checksum`, one int32
    per program. Also what runs in Triton's CPU interpreter, where the checksum shows
    which bytes a launch covered.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import interpreting

PREFETCH_MODES = ("bulk", "lines", "loads")
PREFETCH_BLOCK = 128  # lanes of one program's step (one per thread at 4 warps)
LOADS_BLOCK = 4096  # int32 words one program loads per step in the "loads" mode (16 KiB)


# --8<-- [start:prefetch-kernel]
@triton.jit
def _l2_prefetch_kernel(
    base_ptr, num_bytes, checksum_ptr,
    BYTES_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
):
    """Bring bytes [p * BYTES_PER_PROGRAM, (p + 1) * BYTES_PER_PROGRAM) of the range into L2.

    base_ptr is a uint8 pointer in the "bulk" and "lines" modes, an int32 pointer in "loads"
    (num_bytes then a multiple of 4). Requests past the end are clamped to the range's last
    chunk or line: asking twice costs nothing and needs no mask, which inline PTX cannot take.
    """
    first = tl.program_id(0) * BYTES_PER_PROGRAM
    if MODE == "bulk":  # each lane: one chunk of BYTES_PER_PROGRAM // BLOCK bytes (a multiple of 16)
        CHUNK: tl.constexpr = BYTES_PER_PROGRAM // BLOCK
        start = tl.minimum(first + tl.arange(0, BLOCK) * CHUNK, (num_bytes - 1) // CHUNK * CHUNK)
        size = (tl.minimum(num_bytes - start, CHUNK) + 15) // 16 * 16  # allocations are 512-byte rounded
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [base_ptr + start.to(tl.int64), size.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == "lines":
        for i in range(0, BYTES_PER_PROGRAM, BLOCK * 128):
            line = tl.minimum(first + i + tl.arange(0, BLOCK) * 128, (num_bytes - 1) // 128 * 128)
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [base_ptr + line.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    else:  # "loads": words of 4 bytes, summed (wrapping) into checksum[p]
        total = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in range(0, BYTES_PER_PROGRAM // 4, BLOCK):
            word = first // 4 + i + tl.arange(0, BLOCK)
            total += tl.load(base_ptr + word.to(tl.int64), mask=word < num_bytes // 4, other=0,
                             eviction_policy="evict_last")
        tl.store(checksum_ptr + tl.program_id(0), tl.sum(total, axis=0))
# --8<-- [end:prefetch-kernel]


@functools.lru_cache(maxsize=None)
def _default_mode(device_index: int) -> str:
    return "bulk" if torch.cuda.get_device_capability(device_index)[0] >= 9 else "lines"


def l2_prefetch(tensor: torch.Tensor, max_bytes: int | None = None, mode: str | None = None,
                bytes_per_program: int = 256 << 10) -> torch.Tensor | None:
    """Prefetch the first `max_bytes` (all by default) of `tensor`'s bytes into L2.

    Returns the per-program checksums in the "loads" mode (the only one in the interpreter
    and on the CPU), None otherwise.
    """
    if not tensor.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor (its bytes are one range)")
    if bytes_per_program % (PREFETCH_BLOCK * 16) or bytes_per_program % (4 * LOADS_BLOCK):
        raise ValueError(f"bytes_per_program must be a multiple of {4 * LOADS_BLOCK}, got {bytes_per_program}")
    if interpreting() or tensor.device.type != "cuda":
        mode = "loads"
    elif mode is None:
        mode = _default_mode(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())
    if mode not in PREFETCH_MODES:
        raise ValueError(f"mode must be one of {PREFETCH_MODES}, got {mode!r}")
    num_bytes = tensor.numel() * tensor.element_size()
    if max_bytes is not None:
        num_bytes = min(num_bytes, max_bytes)
    if mode == "loads":
        num_bytes -= num_bytes % 4
    if num_bytes <= 0:
        return None
    raw = tensor.view(-1).view(torch.uint8)
    if mode == "loads":
        raw = raw[: num_bytes].view(torch.int32)
    grid = (triton.cdiv(num_bytes, bytes_per_program),)
    checksum = torch.zeros(grid[0], dtype=torch.int32, device=tensor.device) if mode == "loads" else raw
    _l2_prefetch_kernel[grid](raw, num_bytes, checksum, BYTES_PER_PROGRAM=bytes_per_program,
                              BLOCK=LOADS_BLOCK if mode == "loads" else PREFETCH_BLOCK, MODE=mode, num_warps=4)
    return checksum if mode == "loads" else None


def l2_prefetch_reference(tensor: torch.Tensor, max_bytes: int | None = None,
                          bytes_per_program: int = 256 << 10) -> torch.Tensor:
    """The "loads" mode's checksums: per program, its int32 words summed with wrap-around."""
    raw = tensor.reshape(-1).view(torch.uint8)
    num_bytes = raw.numel() if max_bytes is None else min(raw.numel(), max_bytes)
    num_bytes -= num_bytes % 4
    words = raw[:num_bytes].view(torch.int32).to(torch.int64)
    per_program = bytes_per_program // 4
    num_programs = triton.cdiv(words.numel(), per_program)
    padded = torch.zeros(num_programs * per_program, dtype=torch.int64, device=tensor.device)
    padded[: words.numel()] = words
    sums = padded.view(num_programs, per_program).sum(dim=1)
    return ((sums + 2**31) % 2**32 - 2**31).to(torch.int32)

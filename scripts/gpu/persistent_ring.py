"""The chain of batch-1 products with its weights streamed through shared memory (chapter 06).

    python scripts/gpu/persistent_ring.py --json ring.json      (on the GPU machine, Hopper)

`persistent_chain.py` found that a persistent kernel with grid barriers gains only what it
loads ahead of each barrier, and that registers are too few to hold much: its best variant,
each program's whole next slice of weights in flight, took the 112 products of Qwen3-0.6B's
batch-1 step to 503 µs against a 297 µs floor on an H100. The loads there land in registers,
so a program can have at most one product's slice on the way, and it can only ask for it once
it has finished with the slice before.

This kernel keeps the weights in a ring of shared-memory slots instead, filled with
asynchronous copies (`cp.async`, through Triton's lower-level Gluon dialect, which exposes
shared memory and the copies that Triton proper hides inside its software pipeliner):

- Before the run, each program's weights for the whole chain are laid out as one contiguous
  stream of 8 KiB chunks, in the order it will use them: for every layer and product, its
  rows of the matrix, 8 rows by 512 columns at a time. Weights never depend on activations,
  so the stream can be read at any time, in order, without knowing where a product ends.
- The program keeps STAGES - 1 chunks in flight. Each time it takes a chunk out of the ring
  it asks for the one STAGES - 1 further on, which may belong to the next product or the
  next layer. While it waits at a grid barrier, its copies keep arriving.
- At each product the program waits at the grid barrier, reads the product's input vector
  from L2 into shared memory (SiLU-and-mul for down), and then walks its chunks: each chunk
  times its slice of the input, summed over the chunk's 512 columns, into a float32 row.

A second kernel, the *flow* variant, has no grid barriers at all: each program counts the
products it has finished, and a product starts on each 512-column block of its input as soon
as the programs that wrote that block are done, its partial row sums kept in shared memory.
Its stream holds each product's chunks column block by column block.

A third, the *tagged* kernel, has neither barriers nor counters: every vector between products
is stored as 32-bit words holding a bf16 value and the tag of the phase that wrote it, and a
product reads its input until every word carries its phase's tag, so that the wait and the
read are one round trip (the flag travels with the data, as in NCCL's low-latency protocol).

A timing-only variant (`:nosync` in `--configs`) drops the grid barriers: it shows what the
stream and the products cost with no program waiting for another.

Correctness is checked against float32 on a 2-layer chain, as in `persistent_chain.py`
(same tolerance and the reason for it), before the 28-layer chain is timed. This runs on a
GPU only: the interpreter does not run Gluon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, os.path.join(os.getcwd(), "scripts", "gpu"))
sys.path.insert(0, os.getcwd())
from persistent_chain import MAX_SPINS, TOLERANCE, Chain, print_rows, rel_err  # noqa: E402

CHUNK_ROWS, CHUNK_COLS = 8, 512  # one chunk: 8 KiB of bf16, two 16-byte copies a thread at 8 warps


@gluon.jit
def _issue_chunk(ring, stream_ptr, chunk, total_chunks, offsets, STAGES: gl.constexpr,
                 CHUNK: gl.constexpr):
    """Ask for chunk `chunk` of this program's stream into its ring slot; past the end, nothing
    is read, but a group is still committed so that the wait below counts the same."""
    async_copy.async_copy_global_to_shared(ring.index(chunk % STAGES), stream_ptr + chunk * CHUNK + offsets,
                                           mask=(offsets >= 0) & (chunk < total_chunks))
    async_copy.commit_group()


@gluon.jit
def _grid_arrive(counter_ptr, SYNC: gl.constexpr):
    gl.thread_barrier()  # every thread's stores of this phase are issued before the release
    if SYNC:
        gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _grid_wait(counter_ptr, error_ptr, target, MAX_SPINS: gl.constexpr, SYNC: gl.constexpr):
    if not SYNC:  # the timing-only variant: no barrier, so the inputs are whatever is there
        return
    seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        gl.atomic_add(error_ptr, 1)
    gl.thread_barrier()


@gluon.jit
def _load_input(ptr, cols, TAGGED: gl.constexpr):
    """float32 values another program wrote: bf16 read from L2 (.cg, not this SM's L1), or for
    the tagged kernel 32-bit tagged words read volatile (_untag)."""
    if TAGGED:
        return _untag(gl.load(ptr + cols, volatile=True))
    else:
        return gl.load(ptr + cols, cache_modifier=".cg").to(gl.float32)


@gluon.jit
def _stage_input(x_ptr, x_smem, K: gl.constexpr, INTER: gl.constexpr, GATED: gl.constexpr,
                 CHUNK_COLS: gl.constexpr, vec_layout: gl.constexpr, TAGGED: gl.constexpr = False):
    """The product's input, read into shared memory as float32, one row of CHUNK_COLS per
    column block, all blocks at once. For down it is SiLU(gate) * up, the gate rounded to bf16
    as the engine's separate kernel stores it."""
    for kb in gl.static_range(K // CHUNK_COLS):
        cols = kb * CHUNK_COLS + gl.arange(0, CHUNK_COLS, layout=vec_layout)
        if GATED:
            gate = _load_input(x_ptr, cols, TAGGED)
            up = _load_input(x_ptr + INTER, cols, TAGGED)
            silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
            x_smem.index(kb).store(silu * up)
        else:
            x_smem.index(kb).store(_load_input(x_ptr, cols, TAGGED))
    gl.thread_barrier()


@gluon.jit
def _tag(value, tag):
    """A bf16 value and a phase tag in one 32-bit word: [tag (16 bits) | bf16 bits (16)]. One
    aligned 32-bit store is seen whole or not at all, so a reader that sees the tag sees the value."""
    bits = value.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (tag << 16)


@gluon.jit
def _untag(word):
    return (word & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True).to(gl.float32)


@gluon.jit
def _product(ring, x_smem, stream_ptr, out_ptr, chunk, total_chunks, row0, offsets,
             ROWS: gl.constexpr, K: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
             CHUNK_ROWS: gl.constexpr, CHUNK_COLS: gl.constexpr, w_layout: gl.constexpr,
             out_tag=-1, TAGGED: gl.constexpr = False):
    """out[row0 : row0 + ROWS] = W[rows] @ x, W's rows arriving through the ring in chunk order
    (TAGGED: out holds 32-bit words, each value stored with out_tag)."""
    out_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    x_layout: gl.constexpr = gl.SliceLayout(0, w_layout)
    for rb in range(ROWS // CHUNK_ROWS):
        acc = gl.zeros([CHUNK_ROWS, CHUNK_COLS], gl.float32, layout=w_layout)
        for kb in range(K // CHUNK_COLS):
            # Chunk `chunk` has landed once at most STAGES - 2 younger groups are pending.
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            w = ring.index(chunk % STAGES).load(w_layout)
            # The slot read one step ago is free: refill it, STAGES - 1 chunks ahead.
            _issue_chunk(ring, stream_ptr, chunk + STAGES - 1, total_chunks, offsets, STAGES, CHUNK)
            acc += w.to(gl.float32) * x_smem.index(kb).load(x_layout)[None, :]
            chunk += 1
        rows = row0 + rb * CHUNK_ROWS + gl.arange(0, CHUNK_ROWS, layout=out_layout)
        if TAGGED:
            gl.store(out_ptr + rows, _tag(gl.sum(acc, axis=1), out_tag))
        else:
            gl.store(out_ptr + rows, gl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))
    return chunk


@gluon.jit
def _open_ring(stream_ptr, LAYERS: gl.constexpr, HIDDEN: gl.constexpr, Q: gl.constexpr, INTER: gl.constexpr,
               R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, STAGES: gl.constexpr,
               CHUNK_ROWS: gl.constexpr, CHUNK_COLS: gl.constexpr, w_layout: gl.constexpr):
    """This program's stream, its ring of STAGES slots, and the first STAGES - 1 chunks asked for.
    A chunk is CHUNK_ROWS rows of CHUNK_COLS columns in w_layout: 8 contiguous bf16 (16 bytes,
    one cp.async) a thread, a warp along the columns; the slots are read back in that layout."""
    CHUNK: gl.constexpr = CHUNK_ROWS * CHUNK_COLS
    PER_LAYER: gl.constexpr = (R_QKV * HIDDEN + R_O * Q + R_GU * HIDDEN + R_O * INTER) // CHUNK
    total_chunks = LAYERS * PER_LAYER
    stream_ptr += gl.program_id(0).to(gl.int64) * total_chunks * CHUNK
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, CHUNK_ROWS, CHUNK_COLS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    r = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(1, w_layout))
    c = gl.arange(0, CHUNK_COLS, layout=gl.SliceLayout(0, w_layout))
    offsets = r[:, None] * CHUNK_COLS + c[None, :]
    for s in gl.static_range(STAGES - 1):
        _issue_chunk(ring, stream_ptr, s, total_chunks, offsets, STAGES, CHUNK)
    return stream_ptr, ring, offsets, total_chunks


@gluon.jit
def _ring_chain_kernel(stream_ptr, x_ptr, qkv_ptr, h_ptr, gu_ptr, counter_ptr, error_ptr,
                       LAYERS: gl.constexpr, HIDDEN: gl.constexpr, Q: gl.constexpr, INTER: gl.constexpr,
                       R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, STAGES: gl.constexpr,
                       CHUNK_ROWS: gl.constexpr, CHUNK_COLS: gl.constexpr, MAX_SPINS: gl.constexpr,
                       SYNC: gl.constexpr):
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    vec_layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    CHUNK: gl.constexpr = CHUNK_ROWS * CHUNK_COLS
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    stream_ptr, ring, offsets, total_chunks = _open_ring(stream_ptr, LAYERS, HIDDEN, Q, INTER, R_QKV, R_O, R_GU,
                                                         STAGES, CHUNK_ROWS, CHUNK_COLS, w_layout)
    x_smem = gl.allocate_shared_memory(gl.float32, [INTER // CHUNK_COLS, CHUNK_COLS],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    chunk = 0
    for layer in range(LAYERS):
        phase = layer * 4
        _grid_wait(counter_ptr, error_ptr, phase * nprog, MAX_SPINS, SYNC)
        _stage_input(x_ptr, x_smem, HIDDEN, INTER, False, CHUNK_COLS, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, qkv_ptr, chunk, total_chunks, pid * R_QKV, offsets,
                         R_QKV, HIDDEN, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout)
        _grid_arrive(counter_ptr, SYNC)
        _grid_wait(counter_ptr, error_ptr, (phase + 1) * nprog, MAX_SPINS, SYNC)
        _stage_input(qkv_ptr, x_smem, Q, INTER, False, CHUNK_COLS, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, h_ptr, chunk, total_chunks, pid * R_O, offsets,
                         R_O, Q, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout)
        _grid_arrive(counter_ptr, SYNC)
        _grid_wait(counter_ptr, error_ptr, (phase + 2) * nprog, MAX_SPINS, SYNC)
        _stage_input(h_ptr, x_smem, HIDDEN, INTER, False, CHUNK_COLS, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, gu_ptr, chunk, total_chunks, pid * R_GU, offsets,
                         R_GU, HIDDEN, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout)
        _grid_arrive(counter_ptr, SYNC)
        _grid_wait(counter_ptr, error_ptr, (phase + 3) * nprog, MAX_SPINS, SYNC)
        _stage_input(gu_ptr, x_smem, INTER, INTER, True, CHUNK_COLS, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, x_ptr, chunk, total_chunks, pid * R_O, offsets,
                         R_O, INTER, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout)
        _grid_arrive(counter_ptr, SYNC)
    async_copy.wait_group(0)


@gluon.jit
def _poll_counters(ptrs, mask, POLL_LOAD: gl.constexpr):
    """Each thread reads one producer's counter with acquire order: an atomic read, or (POLL_LOAD)
    a plain load, which many programs can make of one cache line at once where atomics queue."""
    if POLL_LOAD:
        return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=gl.int32, is_pure=False, pack=1)
    else:
        return gl.atomic_add(ptrs, mask.to(gl.int32) * 0, mask=mask, sem="acquire", scope="gpu")


@gluon.jit
def _wait_rows(done_ptr, error_ptr, lo, hi, R_IN: gl.constexpr, target, MAX_SPINS: gl.constexpr,
               POLL_LOAD: gl.constexpr, poll_layout: gl.constexpr):
    """Wait until the programs that wrote rows [lo, hi) of the previous product have finished
    it: program q wrote rows [q * R_IN, (q + 1) * R_IN), and done[q] counts the products it has
    finished. One thread polls each producer's counter."""
    first = lo // R_IN
    count = (hi - 1) // R_IN - first + 1
    q = gl.arange(0, 32 * gl.num_warps(), layout=poll_layout)
    mask = q < count
    ptrs = done_ptr + first + gl.where(mask, q, 0)  # threads without a producer read the first one's
    ready = q * 0 + target
    seen = gl.min(gl.where(mask, _poll_counters(ptrs, mask, POLL_LOAD), ready), axis=0)
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = gl.min(gl.where(mask, _poll_counters(ptrs, mask, POLL_LOAD), ready), axis=0)
        spins += 1
    if seen < target:
        gl.atomic_add(error_ptr, 1)
    gl.thread_barrier()


@gluon.jit
def _flow_product(ring, part_smem, stream_ptr, in_ptr, out_ptr, done_ptr, error_ptr, target, chunk, total_chunks,
                  row0, offsets, ROWS: gl.constexpr, K: gl.constexpr, R_IN: gl.constexpr, GATED: gl.constexpr,
                  INTER: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr, CHUNK_ROWS: gl.constexpr,
                  CHUNK_COLS: gl.constexpr, MAX_SPINS: gl.constexpr, POLL_LOAD: gl.constexpr,
                  w_layout: gl.constexpr, poll_layout: gl.constexpr):
    """out[row0 : row0 + ROWS] = W[rows] @ x, one column block of x at a time, each as soon as
    the programs that wrote it are done: no barrier for the whole product. The partial sums of
    the program's rows stay in shared memory between column blocks."""
    out_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    x_layout: gl.constexpr = gl.SliceLayout(0, w_layout)
    for kb in range(K // CHUNK_COLS):
        lo = kb * CHUNK_COLS
        _wait_rows(done_ptr, error_ptr, lo, lo + CHUNK_COLS, R_IN, target, MAX_SPINS, POLL_LOAD, poll_layout)
        cols = lo + gl.arange(0, CHUNK_COLS, layout=x_layout)
        if GATED:
            _wait_rows(done_ptr, error_ptr, INTER + lo, INTER + lo + CHUNK_COLS, R_IN, target, MAX_SPINS,
                       POLL_LOAD, poll_layout)
            gate = gl.load(in_ptr + cols, cache_modifier=".cg").to(gl.float32)
            up = gl.load(in_ptr + INTER + cols, cache_modifier=".cg").to(gl.float32)
            x = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32) * up
        else:
            x = gl.load(in_ptr + cols, cache_modifier=".cg").to(gl.float32)
        for rb in range(ROWS // CHUNK_ROWS):
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            w = ring.index(chunk % STAGES).load(w_layout)
            _issue_chunk(ring, stream_ptr, chunk + STAGES - 1, total_chunks, offsets, STAGES, CHUNK)
            part = gl.sum(w.to(gl.float32) * x[None, :], axis=1)
            if kb > 0:
                part += part_smem.index(rb).load(out_layout)
            part_smem.index(rb).store(part)
            chunk += 1
    gl.thread_barrier()
    for rb in range(ROWS // CHUNK_ROWS):
        rows = row0 + rb * CHUNK_ROWS + gl.arange(0, CHUNK_ROWS, layout=out_layout)
        gl.store(out_ptr + rows, part_smem.index(rb).load(out_layout).to(out_ptr.dtype.element_ty))
    gl.thread_barrier()  # every thread's stores are issued before the release
    gl.atomic_add(done_ptr + gl.program_id(0), 1, sem="release", scope="gpu")
    return chunk


@gluon.jit
def _flow_chain_kernel(stream_ptr, x_ptr, qkv_ptr, h_ptr, gu_ptr, done_ptr, error_ptr,
                       LAYERS: gl.constexpr, HIDDEN: gl.constexpr, Q: gl.constexpr, INTER: gl.constexpr,
                       R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, STAGES: gl.constexpr,
                       CHUNK_ROWS: gl.constexpr, CHUNK_COLS: gl.constexpr, MAX_SPINS: gl.constexpr,
                       POLL_LOAD: gl.constexpr):
    """The ring kernel without grid barriers: a counter per program (how many products it has
    finished) instead, and each product started on the part of its input that is ready. Its
    stream holds each product's chunks column block by column block (pack_streams with
    columns_first). A program may run ahead only as far as its inputs allow. That never lets it
    overwrite a vector another program still reads: each vector is rewritten a layer later, and
    before that every writer needs an input that every program wrote after reading the old one
    (down reads all of gate_up, qkv all of down, gate_up all of o)."""
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    poll_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    CHUNK: gl.constexpr = CHUNK_ROWS * CHUNK_COLS
    pid = gl.program_id(0)
    stream_ptr, ring, offsets, total_chunks = _open_ring(stream_ptr, LAYERS, HIDDEN, Q, INTER, R_QKV, R_O, R_GU,
                                                         STAGES, CHUNK_ROWS, CHUNK_COLS, w_layout)
    part_smem = gl.allocate_shared_memory(gl.float32, [R_GU // CHUNK_ROWS, CHUNK_ROWS],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    chunk = 0
    for layer in range(LAYERS):
        phase = layer * 4  # a product of phase p needs its producers' done >= p
        chunk = _flow_product(ring, part_smem, stream_ptr, x_ptr, qkv_ptr, done_ptr, error_ptr, phase, chunk,
                              total_chunks, pid * R_QKV, offsets, R_QKV, HIDDEN, R_O, False, INTER, STAGES, CHUNK,
                              CHUNK_ROWS, CHUNK_COLS, MAX_SPINS, POLL_LOAD, w_layout, poll_layout)
        chunk = _flow_product(ring, part_smem, stream_ptr, qkv_ptr, h_ptr, done_ptr, error_ptr, phase + 1, chunk,
                              total_chunks, pid * R_O, offsets, R_O, Q, R_QKV, False, INTER, STAGES, CHUNK,
                              CHUNK_ROWS, CHUNK_COLS, MAX_SPINS, POLL_LOAD, w_layout, poll_layout)
        chunk = _flow_product(ring, part_smem, stream_ptr, h_ptr, gu_ptr, done_ptr, error_ptr, phase + 2, chunk,
                              total_chunks, pid * R_GU, offsets, R_GU, HIDDEN, R_O, False, INTER, STAGES, CHUNK,
                              CHUNK_ROWS, CHUNK_COLS, MAX_SPINS, POLL_LOAD, w_layout, poll_layout)
        chunk = _flow_product(ring, part_smem, stream_ptr, gu_ptr, x_ptr, done_ptr, error_ptr, phase + 3, chunk,
                              total_chunks, pid * R_O, offsets, R_O, INTER, R_GU, True, INTER, STAGES, CHUNK,
                              CHUNK_ROWS, CHUNK_COLS, MAX_SPINS, POLL_LOAD, w_layout, poll_layout)
    async_copy.wait_group(0)


@gluon.jit
def _back_off(spins, POLL_SLEEP_NS: gl.constexpr):
    """Sleep POLL_SLEEP_NS between polls (0: none), so that waiting programs read L2 less often."""
    if POLL_SLEEP_NS > 0:
        return spins + gl.inline_asm_elementwise(f"nanosleep.u32 {POLL_SLEEP_NS}; mov.u32 $0, 1;", "=r", [],
                                                 dtype=gl.int32, is_pure=False, pack=1)
    else:
        return spins + 1


@gluon.jit
def _wait_tagged(words_ptr, offsets, mask, tag, error_ptr, MAX_SPINS: gl.constexpr, POLL_SLEEP_NS: gl.constexpr):
    """Read the words at offsets (volatile: from L2, every time), all at once, until every one
    carries this phase's tag, that is, until the programs that wrote them have stored this
    phase's values."""
    word = gl.load(words_ptr + offsets, mask=mask, other=0, volatile=True)
    spins = 0
    while (gl.min(((word >> 16) == tag).to(gl.int32) | (~mask).to(gl.int32)) == 0) & (spins < MAX_SPINS):
        spins = _back_off(spins, POLL_SLEEP_NS)
        word = gl.load(words_ptr + offsets, mask=mask, other=0, volatile=True)
    if spins == MAX_SPINS:
        gl.atomic_add(error_ptr, 1)


@gluon.jit
def _stage_tagged(words_ptr, x_smem, tag, error_ptr, K: gl.constexpr, INTER: gl.constexpr, GATED: gl.constexpr,
                  CHUNK_COLS: gl.constexpr, MAX_SPINS: gl.constexpr, POLL_SLEEP_NS: gl.constexpr,
                  block_layout: gl.constexpr, vec_layout: gl.constexpr):
    """_stage_input for tagged words, with no barrier before it. First the whole input, as
    [column blocks, CHUNK_COLS] (padded to a power of two), is read until every word is tagged:
    its writers are done. Then _stage_input reads it again. (Seen tagged once, a word keeps this
    phase's value until every program has read it: see _tagged_chain_kernel.)"""
    BLOCKS: gl.constexpr = K // CHUNK_COLS
    PADDED: gl.constexpr = 1 << (BLOCKS - 1).bit_length()
    kb = gl.arange(0, PADDED, layout=gl.SliceLayout(1, block_layout))
    col = gl.arange(0, CHUNK_COLS, layout=gl.SliceLayout(0, block_layout))
    offsets = kb[:, None] * CHUNK_COLS + col[None, :]
    mask = (kb < BLOCKS)[:, None] & (col >= 0)[None, :]
    _wait_tagged(words_ptr, offsets, mask, tag, error_ptr, MAX_SPINS, POLL_SLEEP_NS)
    if GATED:
        _wait_tagged(words_ptr + INTER, offsets, mask, tag, error_ptr, MAX_SPINS, POLL_SLEEP_NS)
    _stage_input(words_ptr, x_smem, K, INTER, GATED, CHUNK_COLS, vec_layout, True)


@gluon.jit
def _tagged_chain_kernel(stream_ptr, x_ptr, qkv_ptr, h_ptr, gu_ptr, error_ptr,
                         LAYERS: gl.constexpr, HIDDEN: gl.constexpr, Q: gl.constexpr, INTER: gl.constexpr,
                         R_QKV: gl.constexpr, R_O: gl.constexpr, R_GU: gl.constexpr, STAGES: gl.constexpr,
                         CHUNK_ROWS: gl.constexpr, CHUNK_COLS: gl.constexpr, MAX_SPINS: gl.constexpr,
                         POLL_SLEEP_NS: gl.constexpr):
    """The ring kernel with no barriers and no counters: every vector between products is
    stored as tagged words (_tag), and a product reads its input until the tags say it is this
    phase's (the flag travels with the data, as in NCCL's low-latency protocol). Phase p's
    output carries tag p + 1; x starts with tag 0, and the other vectors start zeroed, a tag
    no phase after the first expects. As in the flow kernel, no program can overwrite a vector
    that another still reads: each product reads the whole of its input, and a vector is
    rewritten only after a product that needs every program's part of the one before."""
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    block_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    CHUNK: gl.constexpr = CHUNK_ROWS * CHUNK_COLS
    pid = gl.program_id(0)
    stream_ptr, ring, offsets, total_chunks = _open_ring(stream_ptr, LAYERS, HIDDEN, Q, INTER, R_QKV, R_O, R_GU,
                                                         STAGES, CHUNK_ROWS, CHUNK_COLS, w_layout)
    vec_layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    x_smem = gl.allocate_shared_memory(gl.float32, [INTER // CHUNK_COLS, CHUNK_COLS],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    chunk = 0
    for layer in range(LAYERS):
        phase = layer * 4
        _stage_tagged(x_ptr, x_smem, phase, error_ptr, HIDDEN, INTER, False, CHUNK_COLS, MAX_SPINS,
                      POLL_SLEEP_NS, block_layout, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, qkv_ptr, chunk, total_chunks, pid * R_QKV, offsets,
                         R_QKV, HIDDEN, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout, phase + 1, True)
        _stage_tagged(qkv_ptr, x_smem, phase + 1, error_ptr, Q, INTER, False, CHUNK_COLS, MAX_SPINS,
                      POLL_SLEEP_NS, block_layout, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, h_ptr, chunk, total_chunks, pid * R_O, offsets,
                         R_O, Q, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout, phase + 2, True)
        _stage_tagged(h_ptr, x_smem, phase + 2, error_ptr, HIDDEN, INTER, False, CHUNK_COLS, MAX_SPINS,
                      POLL_SLEEP_NS, block_layout, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, gu_ptr, chunk, total_chunks, pid * R_GU, offsets,
                         R_GU, HIDDEN, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout, phase + 3, True)
        _stage_tagged(gu_ptr, x_smem, phase + 3, error_ptr, INTER, INTER, True, CHUNK_COLS, MAX_SPINS,
                      POLL_SLEEP_NS, block_layout, vec_layout)
        chunk = _product(ring, x_smem, stream_ptr, x_ptr, chunk, total_chunks, pid * R_O, offsets,
                         R_O, INTER, STAGES, CHUNK, CHUNK_ROWS, CHUNK_COLS, w_layout, phase + 4, True)
    async_copy.wait_group(0)


def pack_streams(chain: Chain, programs: int, columns_first: bool = False) -> torch.Tensor:
    """Every program's weights for the whole chain, in the order it uses them: [programs, chunks,
    CHUNK_ROWS, CHUNK_COLS]. Program p owns rows [p * R, (p + 1) * R) of each product; within a
    layer its chunks are qkv's, o's, gate_up's, down's, each row block's column blocks in turn
    (or, with columns_first, each column block's row blocks: the flow kernel's order)."""
    order = (1, 0, 4, 2, 3, 5) if columns_first else (1, 0, 2, 4, 3, 5)
    parts = []
    for w in (chain.w_qkv, chain.w_o, chain.w_gu, chain.w_down):
        layers, n, k = w.shape
        rows = n // programs
        blocks = w.reshape(layers, programs, rows // CHUNK_ROWS, CHUNK_ROWS, k // CHUNK_COLS, CHUNK_COLS)
        # -> [programs, layers, row block, column block, CHUNK_ROWS, CHUNK_COLS] (or column, row)
        parts.append(blocks.permute(order).reshape(programs, layers, -1, CHUNK_ROWS, CHUNK_COLS))
    return torch.cat(parts, dim=2).reshape(programs, -1, CHUNK_ROWS, CHUNK_COLS).contiguous()


def ring_tiles(chain: Chain, programs: int) -> dict[str, int]:
    for n, k in ((chain.QKV, chain.HIDDEN), (chain.HIDDEN, chain.Q), (2 * chain.INTER, chain.HIDDEN),
                 (chain.HIDDEN, chain.INTER)):
        if n % (programs * CHUNK_ROWS) or k % CHUNK_COLS:
            raise ValueError(f"a {n} x {k} product does not split into {programs} programs' {CHUNK_ROWS}-row "
                             f"blocks of {CHUNK_COLS} columns")
    return dict(R_QKV=chain.QKV // programs, R_O=chain.HIDDEN // programs, R_GU=2 * chain.INTER // programs)


def run_ring(chain: Chain, stream: torch.Tensor, x0: torch.Tensor, programs: int, stages: int,
             num_warps: int, sync: bool = True) -> torch.Tensor:
    """sync=False drops the grid barriers: every program streams and multiplies its weights
    as fast as it can, on whatever inputs are there. Only its time means anything: what the
    ring and the products cost without the barriers and the waits for other programs."""
    chain.x.copy_(x0)
    chain.counter.zero_()
    _ring_chain_kernel[(programs,)](
        stream, chain.x, chain.qkv, chain.h, chain.gu, chain.counter, chain.errors,
        LAYERS=chain.layers, HIDDEN=chain.HIDDEN, Q=chain.Q, INTER=chain.INTER, **ring_tiles(chain, programs),
        STAGES=stages, CHUNK_ROWS=CHUNK_ROWS, CHUNK_COLS=CHUNK_COLS, MAX_SPINS=MAX_SPINS, SYNC=sync,
        num_warps=num_warps)
    return chain.x


def run_flow(chain: Chain, stream: torch.Tensor, x0: torch.Tensor, done: torch.Tensor, programs: int,
             stages: int, num_warps: int, poll_load: bool = False) -> torch.Tensor:
    """The flow kernel; `stream` packed with columns_first, `done` one int32 per program."""
    chain.x.copy_(x0)
    done.zero_()
    _flow_chain_kernel[(programs,)](
        stream, chain.x, chain.qkv, chain.h, chain.gu, done, chain.errors,
        LAYERS=chain.layers, HIDDEN=chain.HIDDEN, Q=chain.Q, INTER=chain.INTER, **ring_tiles(chain, programs),
        STAGES=stages, CHUNK_ROWS=CHUNK_ROWS, CHUNK_COLS=CHUNK_COLS, MAX_SPINS=MAX_SPINS, POLL_LOAD=poll_load,
        num_warps=num_warps)
    return chain.x


class TaggedVectors:
    """The chain's vectors as tagged 32-bit words, for the tagged kernel."""

    def __init__(self, chain: Chain) -> None:
        def words(n):
            return torch.zeros(n, device=chain.x.device, dtype=torch.int32)
        self.x, self.qkv = words(chain.HIDDEN), words(chain.QKV)
        self.h, self.gu = words(chain.HIDDEN), words(2 * chain.INTER)

    def start(self, x0: torch.Tensor) -> None:
        """x0 with tag 0; the other vectors zeroed (tag 0), which no phase that reads them expects."""
        self.x.copy_(x0.view(torch.int16).to(torch.int32) & 0xFFFF)
        for v in (self.qkv, self.h, self.gu):
            v.zero_()

    @staticmethod
    def values(words: torch.Tensor) -> torch.Tensor:
        low = words & 0xFFFF
        return torch.where(low >= 1 << 15, low - (1 << 16), low).to(torch.int16).view(torch.bfloat16)

    @staticmethod
    def tags(words: torch.Tensor) -> torch.Tensor:
        return words >> 16


def run_tagged(chain: Chain, stream: torch.Tensor, x0: torch.Tensor, vectors: TaggedVectors, programs: int,
               stages: int, num_warps: int, poll_sleep_ns: int = 0) -> torch.Tensor:
    """The tagged kernel; the result is x's values (its tags should all be 4 * layers)."""
    vectors.start(x0)
    _tagged_chain_kernel[(programs,)](
        stream, vectors.x, vectors.qkv, vectors.h, vectors.gu, chain.errors,
        LAYERS=chain.layers, HIDDEN=chain.HIDDEN, Q=chain.Q, INTER=chain.INTER, **ring_tiles(chain, programs),
        STAGES=stages, CHUNK_ROWS=CHUNK_ROWS, CHUNK_COLS=CHUNK_COLS, MAX_SPINS=MAX_SPINS,
        POLL_SLEEP_NS=poll_sleep_ns, num_warps=num_warps)
    return TaggedVectors.values(vectors.x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--programs", type=int, default=128)
    parser.add_argument("--configs", default="4:4,8:4,16:4,24:4,8:8,16:8,24:8,8:4:nosync,24:4:nosync",
                        help="comma-separated STAGES:WARPS, with :nosync for the timing-only variant")
    parser.add_argument("--tagged-configs", default="8:4,24:4,8:8",
                        help="comma-separated STAGES:WARPS[:SLEEP_NS] of the tagged kernel (flags in the data), "
                             "with a sleep between polls")
    parser.add_argument("--flow-configs", default="8:4,24:4,8:8,8:4:ld,24:4:ld,8:8:ld",
                        help="comma-separated STAGES:WARPS of the flow kernel (a counter per program), "
                             "with :ld for polling with plain acquire loads")
    args = parser.parse_args()

    from minivllm.bench.ceilings import copy_bandwidth_gbps, graph_us_per_call

    device = torch.device("cuda")
    chain, short = Chain(28, device), Chain(2, device)
    want = short.reference(short.x0)
    programs = args.programs
    stream, short_stream = pack_streams(chain, programs), pack_streams(short, programs)
    by_columns = {id(chain): pack_streams(chain, programs, True), id(short): pack_streams(short, programs, True)}
    done = torch.zeros(programs, device=device, dtype=torch.int32)
    tagged = {id(chain): TaggedVectors(chain), id(short): TaggedVectors(short)}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "programs": programs, "copy_GBps": copy_bandwidth_gbps(), "weights_MB": chain.nbytes / 1e6,
               "rows": []}
    results["floor_us"] = chain.nbytes / results["copy_GBps"] / 1e3
    variants = [("separate, cuBLAS gate_up", lambda c, s, x: c.separate(x, "cublas")),
                ("persistent slice programs=128 warps=8", lambda c, s, x: c.persistent_slice(x, 128, 8))]
    for config in args.configs.split(","):
        stages, warps, *rest = config.split(":")
        sync = rest != ["nosync"]
        variants.append((f"ring STAGES={stages} warps={warps}" + ("" if sync else " no barriers (time only)"),
                         lambda c, s, x, st=int(stages), w=int(warps), sy=sync: run_ring(c, s, x, programs, st, w, sy)))
    for config in filter(None, args.flow_configs.split(",")):
        stages, warps, *rest = config.split(":")
        ld = rest == ["ld"]
        variants.append((f"flow STAGES={stages} warps={warps}" + (" ld polling" if ld else ""),
                         lambda c, s, x, st=int(stages), w=int(warps), pl=ld:
                         run_flow(c, by_columns[id(c)], x, done, programs, st, w, pl)))
    for config in filter(None, args.tagged_configs.split(",")):
        stages, warps, sleep_ns = (int(v) for v in (config + ":0").split(":")[:3])
        variants.append((f"tagged STAGES={stages} warps={warps}" + (f" sleep {sleep_ns} ns" if sleep_ns else ""),
                         lambda c, s, x, st=stages, w=warps, ns=sleep_ns:
                         run_tagged(c, s, x, tagged[id(c)], programs, st, w, ns)))
    for name, fn in variants:
        row = {"name": name}
        try:
            short.errors.zero_()
            chain.errors.zero_()
            row["rel_err"] = rel_err(fn(short, short_stream, short.x0), want)
            row["us"] = graph_us_per_call(lambda: fn(chain, stream, chain.x0), 1, args.replays)
            row["spin_timeouts"] = short.errors.item() + chain.errors.item()
            if name.startswith("tagged"):  # every word of the result carries the last phase's tag
                row["tags_ok"] = bool((TaggedVectors.tags(tagged[id(short)].x) == 4 * short.layers).all())
                row["spin_timeouts"] += 0 if row["tags_ok"] else 1
            # The timing-only variant computes on stale inputs: its error is not a check.
            row["ok"] = (row["rel_err"] < TOLERANCE or "time only" in name) and row["spin_timeouts"] == 0
        except Exception as exc:  # a configuration that does not compile or fit is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results["rows"].append(row)
        print(row, flush=True)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    print(f"\n{results['device']}, {programs} programs, copy {results['copy_GBps']:.0f} GB/s; "
          f"{results['weights_MB']:.0f} MB of weights, floor {results['floor_us']:.0f} µs")
    print_rows("chain of 112 products", results["rows"], results["floor_us"], 45)


if __name__ == "__main__":
    main()

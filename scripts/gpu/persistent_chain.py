"""Would a persistent kernel make batch-1 decode faster? The products of a step, measured (chapter 06).

    python scripts/gpu/persistent_chain.py --json persistent.json      (on the GPU machine)
    TRITON_INTERPRET=1 python scripts/gpu/persistent_chain.py --check   (the arithmetic, on a CPU)

At batch 1 a Qwen3-0.6B decode step spends most of its time in a chain of matrix-vector
products: per layer qkv (4096 x 1024), o (1024 x 2048), gate_up (6144 x 1024) and down
(1024 x 3072, SiLU-and-mul of its input done inside), 28 layers, 881 MB of weights. Each
product is a kernel; each kernel waits for the one before. This measures that chain of 112
products, each in a CUDA graph replayed many times, four ways:

1. **separate kernels**, as the engine runs them: the skinny GEMM for qkv, o and down, and
   either cuBLAS or the skinny GEMM for gate_up, with programmatic dependent launch (PDL);
2. **one persistent kernel**: one program per SM, looping over the 28 layers; each product
   is a phase in which every program computes some rows, and the phases are separated by a
   grid-wide barrier (a counter in global memory that each program increments, then waits on
   until every program has arrived), the wait polling the counter either with atomic reads
   or with plain loads of acquire order;
3. the same, with **the next phase's first weight tile loaded before the barrier**: weights
   never depend on the activations, so a program can have them on the way while it waits;
4. **barriers alone**: the persistent kernel with no products, what 112 grid barriers cost.

The floor is the weights' bytes over the copy bandwidth measured in the same run. The 112
products are not a whole step (attention, norms, RoPE and the LM head are left out); the
question is only what the chain of products costs as separate kernels and as one.

A grid barrier needs every program resident at once: the grid is one program per SM, and a
spin that never completes gives up after MAX_SPINS and counts itself in an error counter,
which the run checks. Every variant's result is checked against float32 on a 2-layer chain
(see TOLERANCE) before the 28-layer chain is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from minivllm.kernels import skinny_gemm  # noqa: E402

MAX_SPINS = 1 << 20
CHECK_LAYERS = 2


@triton.jit
def _grid_arrive(counter_ptr):
    tl.debug_barrier()  # every thread's stores of this phase are issued before the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _load_acquire(ptr):
    """A plain load with acquire order. The idea: polling with it reads the counter's L2 line
    without taking it, where an atomic read-modify-write queues behind every other program's.
    On an H100 it measured slower than atomic polling (chapter 06)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _poll(counter_ptr, POLL_LOAD: tl.constexpr):
    if POLL_LOAD:
        return _load_acquire(counter_ptr)
    else:
        return tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _grid_wait(counter_ptr, error_ptr, target, MAX_SPINS: tl.constexpr, POLL_LOAD: tl.constexpr):
    seen = _poll(counter_ptr, POLL_LOAD)
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = _poll(counter_ptr, POLL_LOAD)
        spins += 1
    if seen < target:
        tl.atomic_add(error_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _matvec_phase(w_ptr, x_ptr, out_ptr, counter_ptr, error_ptr, target, pid, nprog,
                  N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
                  GATED: tl.constexpr, PREFETCH: tl.constexpr, MAX_SPINS: tl.constexpr,
                  POLL_LOAD: tl.constexpr):
    """out[rows] = W[rows] @ x for this program's blocks of BN rows, after the barrier."""
    cols = tl.arange(0, KP)
    kmask = cols < K
    rows = pid * BN + tl.arange(0, BN)
    wmask = kmask[None, :] & (rows < N)[:, None]
    if PREFETCH:  # the first block's weights are requested before waiting for the activations
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=wmask, other=0.0)
    _grid_wait(counter_ptr, error_ptr, target, MAX_SPINS, POLL_LOAD)
    # Activations were written by other programs: read them from L2 (.cg), not this SM's L1.
    if GATED:
        gate = tl.load(x_ptr + cols, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32) * up
    else:
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if not PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=wmask, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)
    for block in range(pid + nprog, N // BN, nprog):
        rows = block * BN + tl.arange(0, BN)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=kmask[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty))
    _grid_arrive(counter_ptr)


@triton.jit
def _persistent_chain_kernel(x_ptr, qkv_ptr, h_ptr, gu_ptr, w_qkv, w_o, w_gu, w_down, counter_ptr, error_ptr,
                             LAYERS: tl.constexpr, HIDDEN: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr,
                             INTER: tl.constexpr, INTER_P: tl.constexpr, BN: tl.constexpr, PREFETCH: tl.constexpr,
                             MAX_SPINS: tl.constexpr, POLL_LOAD: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for layer in range(LAYERS):
        phase = layer * 4  # phase p waits until all programs have finished phases 0..p-1
        _matvec_phase(w_qkv + layer * QKV * HIDDEN, x_ptr, qkv_ptr, counter_ptr, error_ptr, phase * nprog,
                      pid, nprog, QKV, HIDDEN, HIDDEN, BN, False, PREFETCH, MAX_SPINS, POLL_LOAD)
        _matvec_phase(w_o + layer * HIDDEN * Q, qkv_ptr, h_ptr, counter_ptr, error_ptr, (phase + 1) * nprog,
                      pid, nprog, HIDDEN, Q, Q, BN, False, PREFETCH, MAX_SPINS, POLL_LOAD)
        _matvec_phase(w_gu + layer * 2 * INTER * HIDDEN, h_ptr, gu_ptr, counter_ptr, error_ptr,
                      (phase + 2) * nprog, pid, nprog, 2 * INTER, HIDDEN, HIDDEN, BN, False, PREFETCH, MAX_SPINS, POLL_LOAD)
        _matvec_phase(w_down + layer * HIDDEN * INTER, gu_ptr, x_ptr, counter_ptr, error_ptr,
                      (phase + 3) * nprog, pid, nprog, HIDDEN, INTER, INTER_P, BN, True,
                      PREFETCH, MAX_SPINS, POLL_LOAD)


@triton.jit
def _rows(w_ptr, row0, K: tl.constexpr, ROWS: tl.constexpr, COL0: tl.constexpr, COLS: tl.constexpr):
    """A [ROWS, COLS] tile of a row-major weight with K columns, starting at (row0, COL0)."""
    r = row0 + tl.arange(0, ROWS)
    c = COL0 + tl.arange(0, COLS)
    return tl.load(w_ptr + r[:, None] * K + c[None, :])


@triton.jit
def _dot_store(w, x, out_ptr, row0, ROWS: tl.constexpr):
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + row0 + tl.arange(0, ROWS), acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _read_act(ptr, COL0: tl.constexpr, COLS: tl.constexpr):
    # Written by other programs in the last phase: read from L2 (.cg), not this SM's L1.
    return tl.load(ptr + COL0 + tl.arange(0, COLS), cache_modifier=".cg").to(tl.float32)


@triton.jit
def _read_gated(gu_ptr, INTER: tl.constexpr, COL0: tl.constexpr, COLS: tl.constexpr):
    gate = _read_act(gu_ptr, COL0, COLS)
    up = _read_act(gu_ptr + INTER, COL0, COLS)
    return (gate * tl.sigmoid(gate)).to(gu_ptr.dtype.element_ty).to(tl.float32) * up


@triton.jit
def _gate_up_tiles(gu_base, r_gu, HIDDEN: tl.constexpr, R_GU1: tl.constexpr, R_GU2: tl.constexpr):
    """A program's rows of gate_up, as two power-of-two tiles."""
    return _rows(gu_base, r_gu, HIDDEN, R_GU1, 0, HIDDEN), _rows(gu_base, r_gu + R_GU1, HIDDEN, R_GU2, 0, HIDDEN)


@triton.jit
def _down_tiles(down_base, r_down, INTER: tl.constexpr, R_DOWN: tl.constexpr, K_DOWN1: tl.constexpr,
                K_DOWN2: tl.constexpr):
    """A program's rows of down, its columns as two power-of-two tiles."""
    return (_rows(down_base, r_down, INTER, R_DOWN, 0, K_DOWN1),
            _rows(down_base, r_down, INTER, R_DOWN, K_DOWN1, K_DOWN2))


@triton.jit
def _gated_down(wd1, wd2, gu_ptr, INTER: tl.constexpr, K_DOWN1: tl.constexpr, K_DOWN2: tl.constexpr):
    """down @ (SiLU(gate) * up) for a program's rows, in float32."""
    acc = tl.sum(wd1.to(tl.float32) * _read_gated(gu_ptr, INTER, 0, K_DOWN1)[None, :], axis=1)
    return acc + tl.sum(wd2.to(tl.float32) * _read_gated(gu_ptr, INTER, K_DOWN1, K_DOWN2)[None, :], axis=1)


@triton.jit
def _persistent_slice_kernel(x_ptr, qkv_ptr, h_ptr, gu_ptr, w_qkv, w_o, w_gu, w_down, counter_ptr, error_ptr,
                             LAYERS: tl.constexpr, HIDDEN: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr,
                             INTER: tl.constexpr, R_QKV: tl.constexpr, R_O: tl.constexpr, R_GU1: tl.constexpr,
                             R_GU2: tl.constexpr, K_DOWN1: tl.constexpr, K_DOWN2: tl.constexpr,
                             MAX_SPINS: tl.constexpr):
    """The chain with every program's whole slice of the next product's weights in flight
    while it waits at the barrier: program p owns rows [p * R, (p + 1) * R) of each product.
    As soon as it has stored its rows and arrived, it requests all of its next slice (32-96
    KB) and only then waits. So each SM has tens of KB of weight loads outstanding across the
    barrier instead of one 8-16 row tile, which is what Little's law asks for: at ~25-32 GB/s
    per SM and 1-2 µs of latency under load, one SM needs tens of KB in flight to keep its
    share of the bandwidth busy. Only one product's tile is live at a time (the registers
    hold at most gate_up's 96 KB a program). o and down both have HIDDEN rows: R_O of each."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r_qkv, r_o, r_gu = pid * R_QKV, pid * R_O, pid * (R_GU1 + R_GU2)
    wq = _rows(w_qkv, r_qkv, HIDDEN, R_QKV, 0, HIDDEN)
    for layer in range(LAYERS):
        phase = layer * 4
        _grid_wait(counter_ptr, error_ptr, phase * nprog, MAX_SPINS, False)
        _dot_store(wq, _read_act(x_ptr, 0, HIDDEN), qkv_ptr, r_qkv, R_QKV)
        _grid_arrive(counter_ptr)
        wo = _rows(w_o + layer * HIDDEN * Q, r_o, Q, R_O, 0, Q)

        _grid_wait(counter_ptr, error_ptr, (phase + 1) * nprog, MAX_SPINS, False)
        _dot_store(wo, _read_act(qkv_ptr, 0, Q), h_ptr, r_o, R_O)
        _grid_arrive(counter_ptr)
        wg1, wg2 = _gate_up_tiles(w_gu + layer * 2 * INTER * HIDDEN, r_gu, HIDDEN, R_GU1, R_GU2)

        _grid_wait(counter_ptr, error_ptr, (phase + 2) * nprog, MAX_SPINS, False)
        h = _read_act(h_ptr, 0, HIDDEN)
        _dot_store(wg1, h, gu_ptr, r_gu, R_GU1)
        _dot_store(wg2, h, gu_ptr, r_gu + R_GU1, R_GU2)
        _grid_arrive(counter_ptr)
        wd1, wd2 = _down_tiles(w_down + layer * HIDDEN * INTER, r_o, INTER, R_O, K_DOWN1, K_DOWN2)

        # down, SiLU-and-mul of its input inside
        _grid_wait(counter_ptr, error_ptr, (phase + 3) * nprog, MAX_SPINS, False)
        acc = _gated_down(wd1, wd2, gu_ptr, INTER, K_DOWN1, K_DOWN2)
        tl.store(x_ptr + r_o + tl.arange(0, R_O), acc.to(x_ptr.dtype.element_ty))
        _grid_arrive(counter_ptr)
        # The next layer's qkv slice (the last layer reads its own again rather than past the end).
        next_layer = tl.minimum(layer + 1, LAYERS - 1)
        wq = _rows(w_qkv + next_layer * QKV * HIDDEN, r_qkv, HIDDEN, R_QKV, 0, HIDDEN)


def _split_pow2(n: int) -> tuple[int, int]:
    """n as a power of two plus a smaller power of two (or zero), the tile shapes Triton takes."""
    first = 1 << (n.bit_length() - 1)
    rest = n - first
    if rest & (rest - 1):
        raise ValueError(f"{n} rows is not a sum of two powers of two")
    return first, rest


def slice_tiles(programs: int, qkv_rows: int, hidden: int, inter: int) -> dict[str, int]:
    """The slice kernels' tile shapes: each program's rows of qkv and of o and down (R_QKV,
    R_O), of gate_up as two tiles (R_GU1 + R_GU2), and down's columns as two (K_DOWN1 + K_DOWN2).
    Every product's rows must divide evenly among the programs, into power-of-two tiles."""
    for n in (qkv_rows, hidden, 2 * inter):
        if n % programs:
            raise ValueError(f"{n} rows do not divide among {programs} programs")
    for r in (qkv_rows // programs, hidden // programs):
        if r & (r - 1):
            raise ValueError(f"{r} rows a program is not a power of two")
    r_gu1, r_gu2 = _split_pow2(2 * inter // programs)
    k_down1, k_down2 = _split_pow2(inter)
    if r_gu2 == 0 or k_down2 == 0:
        raise ValueError("the kernels load gate_up and down as two tiles each")
    return dict(R_QKV=qkv_rows // programs, R_O=hidden // programs, R_GU1=r_gu1, R_GU2=r_gu2,
                K_DOWN1=k_down1, K_DOWN2=k_down2)


@triton.jit
def _barriers_kernel(counter_ptr, error_ptr, PHASES: tl.constexpr, MAX_SPINS: tl.constexpr,
                     POLL_LOAD: tl.constexpr):
    nprog = tl.num_programs(0)
    for phase in range(PHASES):
        _grid_wait(counter_ptr, error_ptr, phase * nprog, MAX_SPINS, POLL_LOAD)
        _grid_arrive(counter_ptr)


class Chain:
    """Qwen3-0.6B's four batch-1 products per layer, random weights scaled to keep the vector's size."""

    def __init__(self, layers: int, device: torch.device, hidden: int = 1024, qkv: int = 4096, q: int = 2048,
                 inter: int = 3072):
        self.HIDDEN, self.QKV, self.Q, self.INTER = hidden, qkv, q, inter
        def weight(n, k):
            return (torch.randn(layers, n, k, device=device) * k**-0.5).to(torch.bfloat16)
        h, i = self.HIDDEN, self.INTER
        self.layers = layers
        self.w_qkv, self.w_o = weight(self.QKV, h), weight(h, self.Q)
        self.w_gu, self.w_down = weight(2 * i, h), weight(h, i)
        self.x = torch.randn(h, device=device, dtype=torch.bfloat16)
        self.x0 = self.x.clone()  # the chain's input; the persistent kernel overwrites x with its output
        self.qkv = torch.empty(self.QKV, device=device, dtype=torch.bfloat16)
        self.h = torch.empty(h, device=device, dtype=torch.bfloat16)
        self.gu = torch.empty(2 * i, device=device, dtype=torch.bfloat16)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self.errors = torch.zeros(1, device=device, dtype=torch.int32)
        self.nbytes = sum(w.numel() * 2 for w in (self.w_qkv, self.w_o, self.w_gu, self.w_down))

    def reference(self, x0: torch.Tensor) -> torch.Tensor:
        """float32 products, rounded to bf16 between them as the kernels store them."""
        x = x0
        for layer in range(self.layers):
            qkv = (self.w_qkv[layer].float() @ x.float()).bfloat16()
            h = (self.w_o[layer].float() @ qkv[: self.Q].float()).bfloat16()
            gu = (self.w_gu[layer].float() @ h.float()).bfloat16()
            act = F.silu(gu[: self.INTER].float()).bfloat16().float() * gu[self.INTER:].float()
            x = (self.w_down[layer].float() @ act).bfloat16()
        return x

    def separate(self, x0: torch.Tensor, gate_up: str) -> torch.Tensor:
        x = x0.view(1, -1)
        for layer in range(self.layers):
            qkv = skinny_gemm(x, self.w_qkv[layer])
            h = skinny_gemm(qkv[:, : self.Q], self.w_o[layer])
            gu = F.linear(h, self.w_gu[layer]) if gate_up == "cublas" else skinny_gemm(h, self.w_gu[layer])
            x = skinny_gemm(gu, self.w_down[layer], gated_input=True)
        return x.view(-1)

    def persistent(self, x0: torch.Tensor, programs: int, block_n: int, prefetch: bool, num_warps: int,
                   poll_load: bool = False) -> torch.Tensor:
        self.x.copy_(x0)
        self.counter.zero_()
        _persistent_chain_kernel[(programs,)](
            self.x, self.qkv, self.h, self.gu, self.w_qkv, self.w_o, self.w_gu, self.w_down, self.counter, self.errors,
            LAYERS=self.layers, HIDDEN=self.HIDDEN, QKV=self.QKV, Q=self.Q, INTER=self.INTER,
            INTER_P=triton.next_power_of_2(self.INTER), BN=block_n,
            PREFETCH=prefetch, MAX_SPINS=MAX_SPINS, POLL_LOAD=poll_load, num_warps=num_warps)
        return self.x

    def persistent_slice(self, x0: torch.Tensor, programs: int, num_warps: int) -> torch.Tensor:
        """The slice-in-flight kernel: needs every product's rows to divide among the programs."""
        tiles = slice_tiles(programs, self.QKV, self.HIDDEN, self.INTER)
        self.x.copy_(x0)
        self.counter.zero_()
        _persistent_slice_kernel[(programs,)](
            self.x, self.qkv, self.h, self.gu, self.w_qkv, self.w_o, self.w_gu, self.w_down, self.counter, self.errors,
            LAYERS=self.layers, HIDDEN=self.HIDDEN, QKV=self.QKV, Q=self.Q, INTER=self.INTER, **tiles,
            MAX_SPINS=MAX_SPINS, num_warps=num_warps)
        return self.x

    def barriers(self, programs: int, poll_load: bool) -> None:
        self.counter.zero_()
        _barriers_kernel[(programs,)](self.counter, self.errors, PHASES=4 * self.layers, MAX_SPINS=MAX_SPINS,
                                      POLL_LOAD=poll_load, num_warps=4)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# Checked on a 2-layer chain: the gated product is quadratic in its input, so over 28 layers
# of random weights without norms or residuals the vector grows or vanishes doubly
# exponentially, whatever the scale, and the comparison turns into inf against inf. Two
# layers are 8 products run by the same kernels and phases. bf16 outputs are rounded after
# each product, and a rounding difference from a different float32 summation order (one bf16
# ulp, 2**-8 relative) propagates through the later products; 2e-2 leaves room for that.
TOLERANCE = 2e-2


def check(device: torch.device) -> None:
    """Interpreter-sized check: one layer, one program (a barrier with one program passes at
    once), each product against float32 of the inputs the kernel read. Per product, not the
    whole chain: the interpreter truncates float32 to bf16 instead of rounding to nearest,
    which biases the chain; one truncation is at most one bf16 ulp (2**-7 relative), so 1e-2."""
    full = Chain(1, device)
    # One program holds a whole matrix as one tile, over Triton's 2**20 elements at Qwen3's
    # sizes: the slice kernel is checked on a quarter-width chain of the same structure.
    quarter = Chain(1, device, hidden=256, qkv=1024, q=512, inter=768)
    runs = {f"persistent prefetch={p}": (full, lambda p=p: full.persistent(full.x0, 1, 8, p, 4)) for p in (False, True)}
    runs["persistent slice (quarter width)"] = (quarter, lambda: quarter.persistent_slice(quarter.x0, 1, 4))
    for label, (chain, run) in runs.items():
        x0 = chain.x0
        run()
        assert chain.errors.item() == 0
        gate, up = chain.gu[: chain.INTER].float(), chain.gu[chain.INTER:].float()
        products = {
            "qkv": (chain.qkv, chain.w_qkv[0].float() @ x0.float()),
            "o": (chain.h, chain.w_o[0].float() @ chain.qkv[: chain.Q].float()),
            "gate_up": (chain.gu, chain.w_gu[0].float() @ chain.h.float()),
            "down": (chain.x, chain.w_down[0].float() @ (F.silu(gate) * up)),
        }
        for name, (got, want) in products.items():
            err = rel_err(got, want)
            assert err < 1e-2, (label, name, err)
            print(f"{label} {name}: rel err {err:.2e}")


def print_rows(title: str, rows: list[dict], floor_us: float, width: int) -> None:
    """The timed variants as a table: µs, against the floor, the check's error and verdict."""
    print(f"{title:{width}} {'µs':>7} {'x floor':>7} {'rel err':>8} ok")
    for r in rows:
        if "us" in r:
            print(f"{r['name']:{width}} {r['us']:7.1f} {r['us'] / floor_us:7.2f} {r['rel_err']:8.1e} {r['ok']}")
        else:
            print(f"{r['name']:{width}} {r.get('error')}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--check", action="store_true", help="the arithmetic only, one program (interpreter)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated name parts: time only the variants that match one")
    args = parser.parse_args()
    if args.check:
        check(torch.device("cpu"))
        return

    from minivllm.bench.ceilings import copy_bandwidth_gbps, graph_us_per_call

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chain, short = Chain(28, device), Chain(CHECK_LAYERS, device)
    want = short.reference(short.x0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "sms": sms, "copy_GBps": copy_bandwidth_gbps(), "weights_MB": chain.nbytes / 1e6,
               "check_layers": CHECK_LAYERS, "rows": []}
    results["floor_us"] = chain.nbytes / results["copy_GBps"] / 1e3

    variants = [("separate, cuBLAS gate_up", lambda c, x: c.separate(x, "cublas")),
                ("separate, skinny gate_up", lambda c, x: c.separate(x, "skinny"))]
    for poll_load in (False, True):
        for block_n, num_warps in ((8, 4), (8, 8), (8, 16), (16, 8), (16, 16)):
            for prefetch in (False, True):
                variants.append((f"persistent {'ld' if poll_load else 'atomic'} BN={block_n} warps={num_warps} "
                                 f"prefetch={int(prefetch)}",
                                 lambda c, x, b=block_n, w=num_warps, p=prefetch, pl=poll_load:
                                 c.persistent(x, sms, b, p, w, pl)))
    # 128 programs: every product's rows divide evenly (64 spill registers: chapter 06).
    for programs in (128,):
        for num_warps in (8, 16):
            variants.append((f"persistent slice programs={programs} warps={num_warps}",
                             lambda c, x, p=programs, w=num_warps: c.persistent_slice(x, p, w)))
    if args.only:
        variants = [(name, fn) for name, fn in variants if any(part in name for part in args.only.split(","))]
    for name, fn in variants:
        row = {"name": name}
        try:
            short.errors.zero_()
            chain.errors.zero_()
            row["rel_err"] = rel_err(fn(short, short.x0), want)
            row["us"] = graph_us_per_call(lambda: fn(chain, chain.x0), 1, args.replays)
            row["spin_timeouts"] = short.errors.item() + chain.errors.item()
            row["ok"] = row["rel_err"] < TOLERANCE and row["spin_timeouts"] == 0
        except Exception as exc:  # a configuration that does not compile or fit is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results["rows"].append(row)
        print(row, flush=True)
    phases = 4 * chain.layers

    def time_barriers(programs: int, poll_load: bool) -> float | str:
        """µs for the chain's barriers with nothing between them, or why they did not run."""
        try:
            return graph_us_per_call(lambda: chain.barriers(programs, poll_load), 1, args.replays)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc)[:300]}"

    for poll_load in (False, True):
        key = "barriers_only_ld" if poll_load else "barriers_only_atomic"
        chain.errors.zero_()
        us = time_barriers(sms, poll_load)
        if isinstance(us, str):
            results[key + "_error"] = us
        else:
            results[key + "_us"], results[key + "_spin_timeouts"] = us, chain.errors.item()
    # What one barrier costs as more programs take part (plain-load polling).
    results["barriers_by_programs_us"] = {}
    for programs in sorted({1, 16, 33, 66, sms}):
        us = time_barriers(programs, True)
        results["barriers_by_programs_us"][programs] = us if isinstance(us, str) else us / phases

    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    print(f"\n{results['device']}, {sms} SMs, copy {results['copy_GBps']:.0f} GB/s; "
          f"{results['weights_MB']:.0f} MB of weights, floor {results['floor_us']:.0f} µs")
    for polling in ("atomic", "ld"):
        key = "barriers_only_" + polling
        if key + "_us" in results:
            us = results[key + "_us"]
            print(f"{phases} grid barriers alone, {polling} polling: {us:.1f} µs ({us / phases:.2f} µs each; "
                  f"spin timeouts {results[key + '_spin_timeouts']})")
        else:
            print(f"{phases} grid barriers alone, {polling} polling: {results[key + '_error']}")
    print("one barrier, µs, by programs taking part:", {p: round(v, 2) if isinstance(v, float) else v
                                                          for p, v in results["barriers_by_programs_us"].items()})
    print_rows(f"chain of {phases} products", results["rows"], results["floor_us"], 50)


if __name__ == "__main__":
    main()

"""Registers and occupancy of the skinny GEMM's variants, compiled for an H100/H200 on any machine (chapter 06).

    python scripts/kernel_resources.py

A memory-bound kernel keeps bytes in flight with many programs resident on each
multiprocessor, and a program's registers decide how many fit: 65,536 32-bit registers per SM,
allocated per warp in units of 256. This compiles `_skinny_gemm_kernel` ahead of time for
sm_90a (Triton's bundled ptxas; no GPU needed), once plain and once with each part of the
RMSNorm inside it, at the one-token tile the engine uses, reads the registers from the cubin
(`cuobjdump --dump-resource-usage`) and prints how many programs of that size an SM holds.
The Triton installed here may not be the one on the GPU machine: its numbers are its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minivllm.kernels.gemm import SKINNY_TILE_FEW_TOKENS, _skinny_gemm_kernel

SIGNATURE = {
    "x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
    "x_stride": "i32", "out_stride": "i32", "norm_weight_ptr": "*bf16", "residual_ptr": "*bf16",
    "residual_out_ptr": "*bf16", "eps": "fp32",
}
REGISTERS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 32


def compile_variant(norm: bool, residual: bool, gated: bool = False, norm_weight_ahead: bool = True) -> bytes:
    block_n, block_k, num_warps, num_stages, sum_each_slice = SKINNY_TILE_FEW_TOKENS
    constexprs = {"HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "SUM_EACH_SLICE": sum_each_slice, "USE_PDL": True, "GATED": gated, "NORM": norm, "HAS_RESIDUAL": residual,
                  "NORM_WEIGHT_AHEAD": norm and norm_weight_ahead}
    names = list(SIGNATURE) + list(constexprs)
    source = ASTSource(fn=_skinny_gemm_kernel, signature={**SIGNATURE, **{name: "constexpr" for name in constexprs}},
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm["cubin"]


def registers(cubin: bytes) -> int:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def programs_per_sm(regs: int, num_warps: int) -> int:
    per_program = -(-regs * 32 // 256) * 256 * num_warps  # a warp's registers, in units of 256
    return min(REGISTERS_PER_SM // per_program, MAX_PROGRAMS_PER_SM, 64 // num_warps)  # 64 warps an SM at most


def main() -> None:
    num_warps = SKINNY_TILE_FEW_TOKENS[2]
    print(f"triton {triton.__version__}, sm_90a, one-token tile {SKINNY_TILE_FEW_TOKENS[:2]}, {num_warps} warps")
    print(f"{'variant':<42} {'registers':>9} {'programs / SM':>14}")
    for label, norm, residual, gated, ahead in [
        ("the product alone", False, False, False, True),
        ("SiLU-and-mul inside (down)", False, False, True, True),
        ("RMSNorm inside, no residual (layer 0)", True, False, False, True),
        ("add + RMSNorm inside (qkv, gate_up)", True, True, False, True),
        ("add + RMSNorm, norm weight at use", True, True, False, False),
    ]:
        regs = registers(compile_variant(norm, residual, gated, ahead))
        print(f"{label:<42} {regs:>9} {programs_per_sm(regs, num_warps):>14}")


if __name__ == "__main__":
    main()

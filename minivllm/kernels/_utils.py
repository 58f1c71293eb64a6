"""Small helpers shared by the kernels' launchers (chapter 06)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_kernel_against_reference() -> bool:
    """`MINIVLLM_CHECK_KERNELS=1`: run each kernel's reference beside it and compare."""
    return os.environ.get("MINIVLLM_CHECK_KERNELS", "0") == "1"


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise if a kernel's output differs from its reference (bf16/fp16 tolerances documented)."""
    # Low-precision outputs differ from the reference by rounding of the last bits; 2e-2
    # relative covers bf16's 8-bit mantissa after accumulation in fp32; fp32 must be tight.
    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
    if not torch.isfinite(out.float()).all() or err > tol:
        raise AssertionError(f"kernel {name} disagrees with its reference: relative error {err:.3e} > {tol}")


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when its data pointer is not 16-byte aligned.

    Triton compiles one variant of a kernel per combination of its pointer arguments'
    16-byte alignment. A slice such as `seq_lens[d:]` starts wherever `d` puts it, so passing
    it raw would compile a new variant the first time each alignment shows up: a stall of
    a second or more in the middle of serving. A small copy keeps every call on the one
    aligned (and fastest) variant.
    """
    return t if t.data_ptr() % 16 == 0 else t.clone()


# --8<-- [start:pdl]
@functools.lru_cache(maxsize=None)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # Hopper and newer


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launch with programmatic dependent launch (PDL) here.

    Normally a kernel's programs start only after the previous kernel has finished and its
    writes are flushed: in a decode step at batch 1 that hand-over (the launch, scheduling
    the programs, and the first loads' latency) costs a microsecond or two per kernel, of a
    kernel that moves a few megabytes. With PDL (Hopper and newer) the next kernel is
    launched while the previous one still runs; its programs do what does not depend on the
    previous kernel (load weights, which never change) and then wait in `gdc_wait` until the
    previous kernel's writes are visible. On by default on such GPUs; `MINIVLLM_PDL=0` turns
    it off, and it is off in Triton's CPU interpreter and inside torch.compile's tracing.
    """
    if device.type != "cuda" or interpreting() or os.environ.get("MINIVLLM_PDL", "1") == "0":
        return False
    if torch.compiler.is_compiling():
        return False
    return _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(use_pdl: bool) -> dict:
    """The launch keyword that asks Triton for PDL; nothing when it is off (the interpreter
    does not know the keyword)."""
    return {"launch_pdl": True} if use_pdl else {}
# --8<-- [end:pdl]

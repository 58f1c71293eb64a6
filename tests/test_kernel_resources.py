"""scripts/kernel_resources.py: the occupancy arithmetic, and a real sm_90a compile (chapter 06)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kernel_resources.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_programs_per_sm_follows_the_register_file(script):
    # 65,536 registers an SM; a warp's are allocated in units of 256; 4 warps a program.
    assert script.programs_per_sm(64, 4) == 8  # 64 × 32 × 4 = 8,192 registers a program
    assert script.programs_per_sm(72, 4) == 7  # 2,304 a warp, 9,216 a program
    assert script.programs_per_sm(96, 4) == 5
    assert script.programs_per_sm(16, 4) == 16  # then the 64 warps an SM can hold decide


def test_the_norm_inside_the_product_needs_more_registers():
    # Compiled ahead of time for sm_90a by Triton's own ptxas, no GPU needed; in a process of its
    # own, because the kernels must be defined without the interpreter the CPU tests switch on.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=SCRIPT.parent.parent)
    assert run.returncode == 0, run.stderr
    rows = {line[:42].strip(): [int(v) for v in line[42:].split()] for line in run.stdout.splitlines()[2:]}
    plain, fused = rows["the product alone"], rows["add + RMSNorm inside (qkv, gate_up)"]
    assert 0 < plain[0] < fused[0]
    assert plain[1] > fused[1]  # more registers a program, fewer programs an SM

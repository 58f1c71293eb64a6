"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never download: every model is local (the demo package, or made by the test).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Without a GPU, Triton kernels run in Triton's interpreter, which must be switched on before
# any kernel is defined (i.e. before minivllm.kernels is imported).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The parity tests run minivllm on this device (float32) against transformers on the CPU.
# CI uses the CPU; on a GPU machine run them again with MINIVLLM_TEST_DEVICE=cuda.
TEST_DEVICE = os.environ.get("MINIVLLM_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The converted demo model (SmolLM2-135M-Instruct) as an HF folder.

    Deliberately uses the real user cache, not a tmp dir: the first conversion takes ~30 s and
    ~540 MB, and every later test session (and every test that needs a real model) reuses it.
    """
    from minivllm.models.demo import demo_model_path

    try:
        return demo_model_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise  # CI installs the demo package; a skip there would hide missing coverage
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def demo_llm(demo_model_dir):
    """One engine on the demo model, shared by the tests that only need *a* real model."""
    from minivllm import LLM

    return LLM(str(demo_model_dir), max_model_len=1024, num_gpu_blocks_override=256, device=TEST_DEVICE, dtype="float32")

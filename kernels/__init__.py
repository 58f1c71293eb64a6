"""Triton kernels, each beside its naive PyTorch reference (chapter 06).

Installed as `minivllm.kernels`. `KERNELS` maps each kernel's name to (kernel launcher,
reference); tests check every entry against its reference.
"""

from __future__ import annotations

from collections.abc import Callable

KERNELS: dict[str, tuple[Callable, Callable]] = {}

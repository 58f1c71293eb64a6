"""SiLU-and-mul: the gated MLP's activation, `silu(gate) * up` (chapter 06).

The gate and up projections run as one matmul (`MergedColumnParallelLinear`) whose output is
[gate | up]; this splits it in half and combines the halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.models.layers.custom_ops import call_kernel, use_triton_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_ops(x):
            return call_kernel("silu_and_mul", x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

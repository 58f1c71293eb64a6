"""RMSNorm, optionally fused with the residual add that precedes it (chapter 06).

`RMSNorm(x) = x / sqrt(mean(x²) + eps) * weight`, computed in float32 for stability. In a
pre-norm transformer every norm follows `residual = x + residual`; doing both in one function
lets a fused kernel read x and residual once (the Triton version does exactly that).
`rms_norm_linear` goes one step further for a few tokens on CUDA: the product that reads the
norm's output does the add and the norm itself, and the norm kernel does not run.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.models.layers.custom_ops import call_kernel, norm_in_product_applies, use_triton_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * weight.float()).to(orig_dtype)


# --8<-- [start:rms-norm-layer]
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton_ops(x):
            out, new_residual = call_kernel("fused_add_rms_norm", x, residual, self.weight, self.eps)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        # The sum is kept in the model's dtype, as HF does, so results match it bit for bit.
        residual = x + residual
        return rms_norm(residual, self.weight, self.eps), residual
# --8<-- [end:rms-norm-layer]


# --8<-- [start:rms-norm-linear]
def rms_norm_linear(
    norm: RMSNorm, proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`proj(norm(x + residual))` and the new residual `x + residual` (x itself when residual
    is None): a pre-norm and the column-parallel product after it (qkv, gate_up).

    For the few-token products the skinny GEMM takes on CUDA, one kernel does all three: it
    adds, normalizes as it streams the product's weights, and stores the new residual
    (`rms_norm_skinny_gemm`, chapter 06). Otherwise the fused add + RMSNorm, then the product.
    """
    if norm_in_product_applies(x, proj.weight):
        return call_kernel("rms_norm_skinny_gemm", x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    if residual is None:
        return proj(norm(x)), x
    h, residual = norm(x, residual)
    return proj(h), residual
# --8<-- [end:rms-norm-linear]

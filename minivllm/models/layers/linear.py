"""Linear layers that know which shard of a checkpoint tensor they hold.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`. The model loader
walks the checkpoint and calls it; the layer decides what slice of the tensor is its own.
That is how vLLM (and nano-vllm) load fused layers and tensor-parallel shards with one loop:
  - `ColumnParallelLinear` splits output rows across ranks (no communication needed);
  - `MergedColumnParallelLinear` packs several column layers (gate_proj, up_proj) in one matmul;
  - `QKVParallelLinear` packs q_proj, k_proj, v_proj, sharding heads across ranks;
  - `RowParallelLinear` splits input columns and sums partial outputs with an all-reduce.
Chapter 06 (models) and chapter 10 (tensor parallelism) explain the arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from minivllm.models.layers.custom_ops import linear


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim  # the weight dimension split across ranks (0 = rows, 1 = columns)
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and param.dim() > self.tp_dim:
            shard = param.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        _copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # F.linear, or a Triton kernel for 1-4 tokens


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, get_tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers side by side; `shard_id` says which one a tensor fills."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        _copy_checked(target, loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads are split across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size)
        # With more ranks than KV heads each KV head is replicated; not needed until chapter 10.
        self.num_kv_heads = _divide(num_kv_heads, tp_size)
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        target = param.data.narrow(0, offset, size)
        loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        _copy_checked(target, loaded_weight)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor, gated_input: bool = False) -> torch.Tensor:
        """`gated_input`: x is [gate | up], and silu(gate) * up is done in the product's kernel."""
        # Add the bias once, after the sum, not on every rank.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, gated_input)
        return tensor_model_parallel_all_reduce(y)


def _copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
    target.copy_(source)

"""Who am I in the tensor-parallel group? (chapter 10)

Layers ask `get_tp_rank()` / `get_tp_size()` to know which shard of each weight they hold.
Until tensor parallelism lands every process is rank 0 of a group of 1, and the sharding
arithmetic in the layers reduces to "hold everything": the layers are written TP-aware now so
that adding ranks later changes this file, not the models.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results across the TP group; the identity for a group of one."""
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x)
    return x

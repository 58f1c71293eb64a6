"""Token embedding and LM head, split over the vocabulary for tensor parallelism (chapter 06).

Each rank holds a contiguous slice of the vocabulary. Embedding: a rank looks up the ids in its
slice, writes zeros for the others, and an all-reduce sums the slices. LM head: each rank
computes logits for its slice (gathered across ranks once TP exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()  # the last shard may be shorter than shard_size
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size > 1:
            gathered = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(gathered, logits)
            logits = torch.cat(gathered, dim=-1)
        return logits[..., : self.vocab_size]

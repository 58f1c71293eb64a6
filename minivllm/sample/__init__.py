"""Sampling: logits -> next tokens (chapter 06), batched from `SamplingParams` (chapter 03)."""

from __future__ import annotations

from minivllm.sample.logprobs import make_logprobs_dicts
from minivllm.sample.metadata import SamplingMetadata, build_sampling_metadata
from minivllm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "make_logprobs_dicts",
]

"""`ModelRegistry`: HF `architectures` name → the minivllm class that implements it (chapter 06).

config.json names the model class it was saved from (`"architectures": ["LlamaForCausalLM"]`);
that string is the key. Adding a model means writing its module and one line here.
"""

from __future__ import annotations

from torch import nn

from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

# --8<-- [start:registry]
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # same decoder; sliding window handled by max_model_len
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# --8<-- [end:registry]


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def resolve_model_cls(architectures: list[str] | None) -> type[nn.Module]:
        for arch in architectures or []:
            if arch in _MODELS:
                return _MODELS[arch]
        raise ValueError(
            f"model architecture(s) {architectures} not supported by minivllm; "
            f"supported: {', '.join(ModelRegistry.get_supported_archs())}"
        )

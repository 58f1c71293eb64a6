"""Build a model and fill its weights from a local Hugging Face folder (chapter 06).

The loader streams tensors out of the folder's `*.safetensors` files (memory-mapped, one at a
time) and hands each to the `weight_loader` attached to the parameter it belongs to. Fused
layers are found through the model's `packed_modules_mapping` (q_proj → qkv_proj shard "q").
Every parameter must be filled exactly once: a missing or unexpected tensor is an error that
names it, never a silently random weight. GGUF files arrive here already converted
(`gguf_loader.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minivllm.config import ModelConfig
from minivllm.models.registry import ModelRegistry


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    model_cls = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config.hf_config)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        load_weights(model, iterate_safetensors(Path(model_config.model)))
    return model.eval()


def init_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Random weights of the right shapes, for speed measurements (vLLM's load_format="dummy")."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        param.data.uniform_(low, high, generator=generator)


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(model_dir)!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# --8<-- [start:load-weights]
def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())  # a tied lm_head shares (and is listed as) embed_tokens
    mapping: dict = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue  # recomputed by us / the same tensor as the embedding
        for ckpt_fragment, (fused_fragment, shard_id) in mapping.items():
            if f".{ckpt_fragment}." in name:
                param_name = name.replace(ckpt_fragment, fused_fragment)
                _param(params, param_name, name).weight_loader(params[param_name], tensor, shard_id)
                loaded.add(f"{param_name}#{shard_id}")
                break
        else:
            param = _param(params, name, name)
            getattr(param, "weight_loader", _default_weight_loader)(param, tensor)
            loaded.add(name)
    _check_all_loaded(params, mapping, loaded)
# --8<-- [end:load-weights]


def _param(params: dict[str, nn.Parameter], param_name: str, ckpt_name: str) -> nn.Parameter:
    if param_name not in params:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in the model")
    return params[param_name]


def _default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _check_all_loaded(params: dict[str, nn.Parameter], mapping: dict, loaded: set[str]) -> None:
    shards_of: dict[str, set] = {}
    for fused_fragment, shard_id in mapping.values():
        shards_of.setdefault(fused_fragment, set()).add(shard_id)
    missing = []
    for name in params:
        fused = next((f for f in shards_of if f".{f}." in name), None)
        expected = {f"{name}#{s}" for s in shards_of[fused]} if fused else {name}
        if not expected <= loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))

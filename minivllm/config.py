"""`EngineConfig`: one object that carries every setting of the engine.

vLLM passes a single `VllmConfig` everywhere instead of a dozen loose arguments; minivllm does
the same with `EngineConfig`, which aggregates one small dataclass per concern. Each dataclass
checks its own invariants when it is built, so a bad setting fails at start-up with a message
that names it, never halfway through a run. Chapter 01 (architecture overview) walks through it.

Users rarely build these by hand: `EngineArgs` (minivllm/engine/arg_utils.py) maps vLLM-named
keyword arguments and CLI flags onto them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("minivllm")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# --8<-- [start:model-config]
@dataclass
class ModelConfig:
    """Which model, in which precision, and how long its sequences may be."""

    model: str  # a local Hugging Face folder (after GGUF conversion, if any)
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"  # "auto" | "dummy" (random weights of the right shapes)
    # generation_config.json's eos ids; the engine stops on any of them unless ignore_eos.
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size
# --8<-- [end:model-config]


# --8<-- [start:cache-config]
@dataclass
class CacheConfig:
    """How the paged KV cache is cut into blocks and how many blocks there are."""

    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float = 0.9  # share of the GPU the engine may use in all
    num_gpu_blocks_override: int | None = None  # skip sizing, use exactly this many blocks
    cpu_kv_cache_gb: float = 1.0  # KV budget when the model runs on the CPU
    enable_prefix_caching: bool = True  # reuse the K/V of shared prompt prefixes (chapter 04)
    kv_offloading_size: float = 0.0  # GiB of CPU memory for evicted cached blocks; 0: no CPU tier
    num_gpu_blocks: int | None = None  # decided at start-up by the worker
    num_cpu_blocks: int = 0  # decided at start-up from kv_offloading_size

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 (GiB), got {self.kv_offloading_size}")
        if self.kv_offloading_size > 0 and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size > 0 needs enable_prefix_caching: the CPU tier finds blocks by their hash"
            )
# --8<-- [end:cache-config]


# --8<-- [start:scheduler-config]
@dataclass
class SchedulerConfig:
    """The scheduler's limits: how many requests and tokens one step may hold."""

    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 8192  # the token budget of one step
    enable_chunked_prefill: bool = True  # may a prompt be split across steps?
    max_model_len: int = 2048  # prompt + output tokens of one request
    # What preemption does with the victim's K/V: "recompute" frees its blocks (the cached
    # ones stay findable until evicted); "swap" also copies them to the CPU tier at once.
    preemption_mode: str = "recompute"
    # Schedule step n+1 while step n runs on the device (chapter 05): the host's work hides
    # behind the GPU's; a step's sampled tokens reach the scheduler one step later.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit in one step, or it could never run.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) and chunked prefill is disabled: "
                "long prompts could never be scheduled. Enable chunked prefill or raise the budget."
            )
# --8<-- [end:scheduler-config]


# --8<-- [start:parallel-config]
@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "uni": the worker runs in the engine core's process; "mp": one worker process per rank
    # (chapter 05). None picks "uni" for one rank.
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni"
        if self.distributed_executor_backend not in ("uni", "mp"):
            raise ValueError(
                f"distributed_executor_backend must be 'uni' or 'mp', got {self.distributed_executor_backend!r}"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet (only 1); "
                "see chapter 10 (distributed)."
            )
# --8<-- [end:parallel-config]


# --8<-- [start:compilation-config]
@dataclass
class CompilationConfig:
    """How the model runner makes the forward pass cheap to launch (chapter 05).

    `level` 0 runs the model as plain PyTorch; 1 runs it through `torch.compile` (attention
    stays outside the compiled graphs). Independently, on CUDA, `cudagraph_mode` says which
    steps replay CUDA graphs (none of them when `enforce_eager` is set), as vLLM's option of
    that name does:

      * "full_decode_only": decode-only steps replay one graph of the whole forward pass,
        captured at `cuda_graph_sizes` batch sizes; every other step runs eagerly;
      * "piecewise": every step whose token count fits `piecewise_cuda_graph_sizes` replays
        the pieces of the forward pass between attention calls, attention running eagerly;
      * "full_and_piecewise" (the default): full graphs for decode-only steps, pieces for
        the rest (prefills, and decodes mixed with them);
      * "none": no graphs (the same as `enforce_eager`).
    """

    level: int = 0
    enforce_eager: bool = False
    cudagraph_mode: str = "full_and_piecewise"
    cuda_graph_sizes: list[int] | None = None  # None: 1, 2, 4, 8, then every 16 up to max_num_seqs
    # Token counts; None: 1, 2, 4, 8, every 16 up to 256, then four sizes per doubling up to
    # max_num_batched_tokens.
    piecewise_cuda_graph_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if self.level not in (0, 1):
            raise ValueError(f"compilation level must be 0 (eager) or 1 (torch.compile), got {self.level}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        for name in ("cuda_graph_sizes", "piecewise_cuda_graph_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                if not sizes or any(int(n) < 1 for n in sizes):
                    raise ValueError(f"{name} must be positive sizes, got {sizes}")
                setattr(self, name, sorted({int(n) for n in sizes}))

    @property
    def full_decode_graphs(self) -> bool:
        return not self.enforce_eager and self.cudagraph_mode in ("full_decode_only", "full_and_piecewise")

    @property
    def piecewise_graphs(self) -> bool:
        return not self.enforce_eager and self.cudagraph_mode in ("piecewise", "full_and_piecewise")


CUDAGRAPH_MODES = ("none", "full_decode_only", "piecewise", "full_and_piecewise")
# --8<-- [end:compilation-config]


# --8<-- [start:device-config]
@dataclass
class DeviceConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but torch sees no CUDA device")
        if self.device == "cuda":  # pin the index: memory queries and set_device need one
            self.device = f"cuda:{torch.cuda.current_device()}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
# --8<-- [end:device-config]


# --8<-- [start:engine-config]
@dataclass
class EngineConfig:
    """vLLM's `VllmConfig`: every sub-config in one object, passed everywhere."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    attention_backend: str = "torch"
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        if self.scheduler_config.preemption_mode == "swap" and self.cache_config.kv_offloading_size <= 0:
            raise ValueError("preemption_mode='swap' needs a CPU tier to swap to: set kv_offloading_size (GiB) > 0")
        if self.scheduler_config.async_scheduling and self.parallel_config.distributed_executor_backend != "uni":
            raise ValueError("async_scheduling runs with the in-process executor only (distributed_executor_backend='uni')")
# --8<-- [end:engine-config]


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """`auto` means bf16 on CUDA (fast, range of fp32) and fp32 on CPU (bf16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def read_eos_token_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """eos ids from generation_config.json (which may list several), else from config.json."""
    import json

    eos: Any = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

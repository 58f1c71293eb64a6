"""`EngineArgs`: vLLM-named settings (keyword arguments and CLI flags) → `EngineConfig`.

`LLM(model, max_model_len=..., gpu_memory_utilization=...)` and `minivllm run --max-model-len ...`
both land here. This is the only place that knows the user-facing names; the rest of the
engine reads `EngineConfig`. Chapter 01 explains the split.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

from minivllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    logger,
    read_eos_token_ids,
    resolve_dtype,
)

ATTENTION_BACKENDS = ("torch", "triton")


# --8<-- [start:engine-args]
@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded demo model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random (benchmarks)
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_gb: float = 1.0
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0  # GiB of CPU memory for offloaded KV blocks (0: none)
    preemption_mode: str = "recompute"  # "recompute" | "swap" (needs kv_offloading_size > 0)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False  # schedule the next step while this one runs (chapter 05)
    tensor_parallel_size: int = 1
    device: str = "auto"
    attention_backend: str | None = None  # "torch" | "triton"; default: triton on CUDA, torch on CPU
    enforce_eager: bool = False  # no CUDA graphs
    compilation_level: int = 0  # 0: eager PyTorch; 1: torch.compile
    cudagraph_mode: str = "full_and_piecewise"  # "none" | "full_decode_only" | "piecewise" | "full_and_piecewise"
    cuda_graph_sizes: str | None = None  # decode batch sizes to capture, "1,2,4,8"; None: the default ladder
    piecewise_cuda_graph_sizes: str | None = None  # token counts to capture piecewise; None: the default ladder
    distributed_executor_backend: str | None = None  # "uni" | "mp" (one worker process per rank)
# --8<-- [end:engine-args]

    def create_engine_config(self) -> EngineConfig:
        model_dir = resolve_model_path(self.model)
        hf_config = load_hf_config(model_dir)
        device_config = DeviceConfig(self.device)
        dtype = resolve_dtype(self.dtype, device_config.device)
        max_model_len = _derive_max_model_len(hf_config, self.max_model_len)
        # The token budget defaults to vLLM's v1 default for offline use, but never below
        # max_model_len when chunking is off (the scheduler config checks that case).
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        # Triton kernels are the default on CUDA; the torch reference is the default on the CPU.
        backend = self.attention_backend or ("triton" if device_config.device.startswith("cuda") else "torch")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        model_config = ModelConfig(
            model=str(model_dir),
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            tokenizer=self.tokenizer or str(model_dir),
            skip_tokenizer_init=self.skip_tokenizer_init,
            load_format=self.load_format,
            eos_token_ids=read_eos_token_ids(model_dir, hf_config),
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cpu_kv_cache_gb=self.cpu_kv_cache_gb,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_offloading_size=self.kv_offloading_size,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_model_len=max_model_len,
                preemption_mode=self.preemption_mode,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend),
            device_config=device_config,
            attention_backend=backend,
            compilation_config=CompilationConfig(
                level=self.compilation_level,
                enforce_eager=self.enforce_eager,
                cudagraph_mode=self.cudagraph_mode,
                cuda_graph_sizes=_parse_sizes(self.cuda_graph_sizes, "cuda_graph_sizes"),
                piecewise_cuda_graph_sizes=_parse_sizes(self.piecewise_cuda_graph_sizes, "piecewise_cuda_graph_sizes"),
            ),
        )

    # -- command line ---------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--kebab-case` flag per field, as `vllm serve` spells them."""
        group = parser.add_argument_group("engine")
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            group.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {sorted(known)}")
        return dataclasses.replace(cls(), model=model, **kwargs)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """`EngineArgs` for `AsyncLLM`, as vLLM names them; the same fields (chapter 02)."""


def _parse_sizes(sizes: str | list[int] | None, name: str) -> list[int] | None:
    """`--cuda-graph-sizes 1,2,4,8` (or a list from Python) → [1, 2, 4, 8]."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    try:
        return [int(n) for n in str(sizes).split(",") if n.strip()]
    except ValueError as err:
        raise ValueError(f"{name} must be comma-separated integers, got {sizes!r}") from err


def resolve_model_path(model: str | None) -> Path:
    """A local HF folder for `model`: None → the demo model, a .gguf file → its converted folder."""
    if model is None:
        from minivllm.models.demo import demo_model_path

        return demo_model_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        from minivllm.models.gguf_loader import resolve_gguf

        return resolve_gguf(path)
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist. minivllm loads local Hugging Face folders "
            "(config.json + *.safetensors) or .gguf files; it never downloads."
        )
    if not (path / "config.json").exists():
        raise ValueError(f"model folder {str(path)!r} has no config.json: not a Hugging Face model folder")
    return path


def load_hf_config(model_dir: Path):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError) as err:
        raise ValueError(f"cannot read {model_dir / 'config.json'}: {err}") from err


def _derive_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < limit:
        # Inside the window full attention equals sliding-window attention, so capping the
        # length keeps results exact without a sliding-window mask in every backend.
        logger.info("sliding_window=%d: max_model_len capped at the window", window)
        limit = window
    if requested is None:
        return limit
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is larger than the model allows ({limit}: "
            "max_position_embeddings, or the sliding window)"
        )
    return requested

"""`Worker`: one device's share of the work — set up the device, load the model, size and
allocate the KV cache, capture CUDA graphs, run steps. Chapter 05 (executor & worker).

How many KV blocks fit:
  * `num_gpu_blocks_override` set: exactly that many (tests use it to force preemption);
  * CPU: `cpu_kv_cache_gb` of memory;
  * CUDA: what is left of `gpu_memory_utilization × total memory` after other processes, the
    weights and the activation peak of a dummy forward pass at the largest step size.
"""

from __future__ import annotations

import logging

import torch

from minivllm.config import EngineConfig
from minivllm.executor.model_runner import ModelRunner
from minivllm.scheduler.output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("minivllm")


# --8<-- [start:num-kv-blocks]
# exercise[ch05-kv-cache-sizing]: budget = total * utilization - used_by_others - peak; whole blocks of bytes_per_block; never below 0
def num_kv_blocks(
    total_bytes: int, gpu_memory_utilization: float, used_by_others: int, peak_bytes: int, bytes_per_block: int
) -> int:
    """How many KV cache blocks fit in what the profile left over.

    The engine may use `gpu_memory_utilization` of the card's `total_bytes`. Out of that go
    the memory other processes hold (`used_by_others`) and this process's peak during the
    profiling run (`peak_bytes`: weights plus the activations of the largest step). The rest
    is cut into blocks of `bytes_per_block`; a budget below zero means no block at all.
    """
    budget = total_bytes * gpu_memory_utilization - used_by_others - peak_bytes
    return max(0, int(budget) // bytes_per_block)
# --8<-- [end:num-kv-blocks]


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device_config.torch_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)
        self.memory_profile: dict[str, float] = {}

    def load_model(self) -> None:
        self.model_runner.load_model()

    # --8<-- [start:determine-num-blocks]
    def determine_num_available_blocks(self) -> int:
        cache = self.config.cache_config
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block()
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cpu":
            return int(cache.cpu_kv_cache_gb * (1 << 30)) // bytes_per_block
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        peak = self.model_runner.profile_peak_memory()  # weights + activations of the largest step
        torch.cuda.empty_cache()
        num_blocks = num_kv_blocks(total, cache.gpu_memory_utilization, used_by_others, peak, bytes_per_block)
        self._report(total, used_by_others, weights, peak, num_blocks, bytes_per_block)
        return num_blocks
    # --8<-- [end:determine-num-blocks]

    def _report(self, total: int, others: int, weights: int, peak: int, num_blocks: int, bytes_per_block: int) -> None:
        """Log the memory budget, and refuse to start when one full-length request cannot fit."""
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        blocks_per_request = -(-max_model_len // block_size)
        max_concurrency = num_blocks / blocks_per_request
        gib = 2**30
        self.memory_profile = {
            "total_GiB": total / gib, "used_by_others_GiB": others / gib, "weights_GiB": weights / gib,
            "activation_peak_GiB": (peak - weights) / gib, "kv_cache_GiB": num_blocks * bytes_per_block / gib,
            "num_blocks": num_blocks, "max_concurrency": max_concurrency,
            "gpu_memory_utilization": self.config.cache_config.gpu_memory_utilization,
        }
        logger.info(
            "memory: %.1f GiB × %.2f; others %.2f GiB, weights %.2f GiB, activation peak %.2f GiB → "
            "%d KV blocks (%.2f GiB); %.1f requests of max_model_len=%d fit at once",
            total / gib, self.config.cache_config.gpu_memory_utilization, others / gib, weights / gib,
            (peak - weights) / gib, num_blocks, num_blocks * bytes_per_block / gib, max_concurrency, max_model_len,
        )
        if num_blocks < blocks_per_request:
            raise ValueError(
                f"not even one request of max_model_len={max_model_len} fits in the KV cache: it needs "
                f"{blocks_per_request} blocks of {block_size} tokens ({blocks_per_request * bytes_per_block / gib:.2f} GiB), "
                f"and {num_blocks} fit ({total / gib:.1f} GiB × gpu_memory_utilization "
                f"{self.config.cache_config.gpu_memory_utilization} − others {others / gib:.2f} − weights "
                f"{weights / gib:.2f} − activations {(peak - weights) / gib:.2f} GiB). Lower max_model_len or "
                "max_num_batched_tokens, or raise gpu_memory_utilization."
            )

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        """After the cache exists: compile the kernels, capture the decode CUDA graphs (CUDA)."""
        self.model_runner.warm_up_kernels()
        self.model_runner.capture_cuda_graphs()
        from minivllm.engine.core import freeze_gc_heap  # imported late: core imports the executors

        freeze_gc_heap()  # in a worker process its own heap; in-process, the engine freezes again after

    # --8<-- [start:worker-execute]
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_kv_transfers(scheduler_output.kv_transfers)
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        self.execute_kv_transfers(scheduler_output.kv_transfers)
        return self.model_runner.execute_model_async(scheduler_output)
    # --8<-- [end:worker-execute]

    # --8<-- [start:execute-kv-transfers]
    cpu_kv_cache = None  # KV offloading's host tensors (chapter 04), made on the first copy

    def execute_kv_transfers(self, transfers) -> None:  # transfers: KVTransfers | None
        """KV offloading: copy blocks between the GPU cache and the CPU tier, before the forward."""
        if not transfers:
            return
        from minivllm.kv_cache.offload import CPUKVCache, num_cpu_blocks

        if self.cpu_kv_cache is None:
            self.cpu_kv_cache = CPUKVCache(self.model_runner.kv_caches, num_cpu_blocks(self.config))
        self.cpu_kv_cache.execute(transfers)
    # --8<-- [end:execute-kv-transfers]

    def get_memory_profile(self) -> dict[str, float]:
        return self.memory_profile

    def get_pid(self) -> int:
        import os

        return os.getpid()

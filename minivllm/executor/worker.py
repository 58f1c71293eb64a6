"""`Worker`: one device's share of the work — set up the device, load the model, size and
allocate the KV cache, run steps. Chapter 05 (executor & worker).

How many KV blocks fit:
  * `num_gpu_blocks_override` set: exactly that many (tests use it to force preemption);
  * CPU: `cpu_kv_cache_gb` of memory;
  * CUDA: what is left of `gpu_memory_utilization × total memory` after the weights, other
    processes and the peak of a dummy forward pass at the largest step size.
"""

from __future__ import annotations

import logging

import torch

from minivllm.config import EngineConfig
from minivllm.executor.model_runner import ModelRunner
from minivllm.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("minivllm")


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.torch_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)

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
        peak = self.model_runner.profile_peak_memory()  # weights + activations of the largest step
        torch.cuda.empty_cache()
        available = total * cache.gpu_memory_utilization - used_by_others - peak
        num_blocks = int(available) // bytes_per_block
        logger.info(
            "memory: total %.1f GiB, others %.1f GiB, weights+activations peak %.2f GiB → %d KV blocks (%.2f GiB)",
            total / 2**30, used_by_others / 2**30, peak / 2**30, num_blocks, num_blocks * bytes_per_block / 2**30,
        )
        return num_blocks
    # --8<-- [end:determine-num-blocks]

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_kv_transfers(scheduler_output.kv_transfers)
        return self.model_runner.execute_model(scheduler_output)

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


"""KV offloading: a bounded CPU tier under the prefix cache.

The GPU prefix cache keeps the K/V of freed blocks until their memory is needed; then they are
evicted and lost, and the next request with that prefix recomputes it. With a CPU tier an
evicted cached block is first copied to host memory (pinned on CUDA, so the copy is a fast
DMA), and a later hit on its hash copies it back into a fresh GPU block instead of running
the model over those tokens again. Copying 2 × layers × block_size × kv_heads × head_dim
numbers is far cheaper than computing them.

Two halves, as everywhere in minivllm (DESIGN.md §3: the scheduler speaks in block ids):
  * `CPUOffloadTier` lives on the scheduler side: which hash sits in which CPU block, LRU
    order, and the copies each step must make (`KVTransfers`, sent in the SchedulerOutput);
  * `CPUKVCache` lives in the worker: the host tensors, and `execute` runs a step's copies
    before its forward pass.
Swap preemption (`preemption_mode="swap"`) uses the same tier: a preempted request's full
blocks are copied out at once, and its resume finds them there. Chapter 04 ("KV offloading").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from minivllm.kv_cache.block_hash import BlockHash


# --8<-- [start:kv-transfers]
@dataclass
class KVTransfers:
    """Block copies between the GPU cache and the CPU tier, run before a step's forward pass.

    Stores run first, then loads. A store may target a GPU block that a load then refills (the
    block was evicted and handed out again in the same step), so that order is required; the
    tier never reuses a CPU block that a load of the same step still reads.
    """

    gpu_to_cpu: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    cpu_to_gpu: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)

    def __bool__(self) -> bool:
        return bool(self.gpu_to_cpu or self.cpu_to_gpu)
# --8<-- [end:kv-transfers]


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens in every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_cpu_blocks(config) -> int:  # config: EngineConfig
    """How many blocks `kv_offloading_size` GiB hold (0: no CPU tier). Scheduler and worker agree."""
    cache, model = config.cache_config, config.model_config
    if cache.kv_offloading_size <= 0:
        return 0
    bytes_per_block = kv_cache_bytes_per_block(model.num_layers, cache.block_size, model.num_kv_heads, model.head_dim, model.dtype)
    num_blocks = int(cache.kv_offloading_size * (1 << 30)) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_offloading_size={cache.kv_offloading_size} GiB holds no KV block of {bytes_per_block} bytes")
    return num_blocks


# --8<-- [start:cpu-offload-tier]
class CPUOffloadTier:
    """Which block hash is stored in which CPU block; least recently used evicted first."""

    def __init__(self, num_cpu_blocks: int) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"the CPU tier needs at least one block, got {num_cpu_blocks}")
        self.num_cpu_blocks = num_cpu_blocks
        self.hash_to_cpu_block: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self.free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))  # pop() gives 0 first
        self.pending = KVTransfers()
        self._read_this_step: set[int] = set()  # CPU blocks a pending load reads: not reusable
        self.num_stored = 0  # blocks copied GPU → CPU, in all (statistics)
        self.num_loaded = 0  # blocks copied CPU → GPU, in all

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.hash_to_cpu_block

    def store(self, block_hash: BlockHash, gpu_block_id: int) -> bool:
        """Copy a GPU block's K/V into the tier under its hash; False if there is no room."""
        if block_hash in self.hash_to_cpu_block:
            self.hash_to_cpu_block.move_to_end(block_hash)  # already there: just fresher
            return True
        cpu_block = self._take_cpu_block()
        if cpu_block is None:
            return False
        self.hash_to_cpu_block[block_hash] = cpu_block
        self.pending.gpu_to_cpu.append((gpu_block_id, cpu_block))
        self.num_stored += 1
        return True

    def load(self, block_hash: BlockHash, gpu_block_id: int) -> None:
        """Copy the tier's block for `block_hash` into GPU block `gpu_block_id` (a hit)."""
        cpu_block = self.hash_to_cpu_block[block_hash]
        self.hash_to_cpu_block.move_to_end(block_hash)
        self._read_this_step.add(cpu_block)
        self.pending.cpu_to_gpu.append((cpu_block, gpu_block_id))
        self.num_loaded += 1

    def take_transfers(self) -> KVTransfers:
        """The copies of this step, for the SchedulerOutput; the tier starts a new step."""
        transfers, self.pending = self.pending, KVTransfers()
        self._read_this_step.clear()
        return transfers

    def reset(self) -> None:
        """Forget every stored block (`reset_prefix_cache`)."""
        self.hash_to_cpu_block.clear()
        self.free_cpu_blocks = list(range(self.num_cpu_blocks - 1, -1, -1))
        self.pending = KVTransfers()
        self._read_this_step.clear()

    def _take_cpu_block(self) -> int | None:
        if self.free_cpu_blocks:
            return self.free_cpu_blocks.pop()
        for block_hash, cpu_block in self.hash_to_cpu_block.items():  # LRU first
            if cpu_block not in self._read_this_step:
                del self.hash_to_cpu_block[block_hash]
                return cpu_block
        return None  # every CPU block is being read this step
# --8<-- [end:cpu-offload-tier]


# --8<-- [start:cpu-kv-cache]
class CPUKVCache:
    """The worker's half: one host tensor per layer, shaped like the GPU cache, and the copies."""

    def __init__(self, gpu_kv_caches: list[torch.Tensor], num_cpu_blocks: int) -> None:
        pin = gpu_kv_caches[0].is_cuda  # pinned host memory: the copies are asynchronous DMAs
        self.gpu_kv_caches = gpu_kv_caches
        self.cpu_kv_caches = [
            torch.zeros((c.shape[0], num_cpu_blocks, *c.shape[2:]), dtype=c.dtype, device="cpu", pin_memory=pin)
            for c in gpu_kv_caches
        ]

    def execute(self, transfers: KVTransfers) -> None:
        """Run a step's copies: stores first, then loads (see `KVTransfers`).

        Every copy is queued on the current CUDA stream, the one the forward pass runs on, so
        a store finishes reading a GPU block before the forward overwrites it, and a load
        reads a CPU block only after a store of the same step wrote it: no waiting needed.
        Each run of consecutive CPU blocks crosses the bus as one slab per layer and K/V; the
        GPU side gathers or scatters its (scattered) blocks with one indexed copy.
        """
        for cpu_start, gpu_ids in cpu_block_runs([(cpu, gpu) for gpu, cpu in transfers.gpu_to_cpu]):
            index = torch.tensor(gpu_ids, device=self.gpu_kv_caches[0].device)
            end = cpu_start + len(gpu_ids)
            for gpu_cache, cpu_cache in zip(self.gpu_kv_caches, self.cpu_kv_caches):
                gathered = gpu_cache[:, index]  # [2, n, block_size, kv_heads, head_dim]
                for kv in (0, 1):
                    cpu_cache[kv, cpu_start:end].copy_(gathered[kv], non_blocking=True)
        for cpu_start, gpu_ids in cpu_block_runs(transfers.cpu_to_gpu):
            index = torch.tensor(gpu_ids, device=self.gpu_kv_caches[0].device)
            end = cpu_start + len(gpu_ids)
            for gpu_cache, cpu_cache in zip(self.gpu_kv_caches, self.cpu_kv_caches):
                for kv in (0, 1):
                    slab = cpu_cache[kv, cpu_start:end].to(gpu_cache.device, non_blocking=True)
                    gpu_cache[kv].index_copy_(0, index, slab)


def cpu_block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(cpu block, gpu block) pairs → runs (first cpu block, the gpu blocks of the run, in order).

    The copies of one direction are independent of each other, so they may be reordered: by
    CPU block, then cut where the CPU ids stop being consecutive. A prefix evicted together
    was stored in consecutive CPU blocks, so it usually comes back as one run.
    """
    runs: list[tuple[int, list[int]]] = []
    for cpu, gpu in sorted(pairs):
        if runs and cpu == runs[-1][0] + len(runs[-1][1]):
            runs[-1][1].append(gpu)
        else:
            runs.append((cpu, [gpu]))
    return runs
# --8<-- [end:cpu-kv-cache]

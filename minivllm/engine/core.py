"""`EngineCore`: the scheduler and the executor, stepped together.

`step()` is the heartbeat of the engine: schedule → execute the model → update requests from
what was sampled. In the offline engine the core runs in the caller's process; chapter 02
moves it into a process of its own (`core_proc.py`), behind the same methods.
"""

from __future__ import annotations

import gc
import logging
import time

from minivllm.config import EngineConfig
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from minivllm.executor.executor_base import executor_class
from minivllm.kv_cache.manager import cdiv, make_kv_cache_manager, prefix_cache_stats
from minivllm.request import RequestStatus
from minivllm.scheduler.output import AsyncModelRunnerOutput, SchedulerOutput
from minivllm.scheduler.scheduler import Scheduler
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("minivllm")


# --8<-- [start:freeze-gc-heap]
def freeze_gc_heap() -> None:
    """Move every object alive now out of the garbage collector's sight (chapter 05).

    Python's cyclic collector runs when allocations outnumber deallocations by a threshold,
    and each full collection walks every tracked object: after loading torch, transformers
    and a model, hundreds of thousands of them. A busy step loop allocates enough small lists
    and dicts to trigger such collections every few steps, milliseconds each on the host's
    critical path. What exists at the end of start-up (modules, the model, the engine) lives
    as long as the process, so it is frozen: collections then walk only what steps create.
    """
    gc.collect()
    gc.freeze()
# --8<-- [end:freeze-gc-heap]


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # "uni": the worker in this process; "mp": one worker process per rank (chapter 05).
        self.executor = executor_class(config)(config)
        num_blocks = self.executor.determine_num_available_blocks()
        block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        if num_blocks < cdiv(max_model_len, block_size):
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {block_size} tokens, fewer than one request "
                f"of max_model_len={max_model_len} needs ({cdiv(max_model_len, block_size)}). "
                "Lower max_model_len, or give the cache more memory."
            )
        config.cache_config.num_gpu_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        self.scheduler = Scheduler(config.scheduler_config, make_kv_cache_manager(config, num_blocks))
        # Structured output (chapter 11): compiles grammars off the step loop, fills the bitmask.
        self.structured_output_manager = StructuredOutputManager(config)
        # Statistics for `minivllm run` and, later, the metrics endpoint.
        self.last_scheduler_output: SchedulerOutput | None = None
        self.num_steps = 0
        self.peak_num_blocks_used = 0
        self.busy_seconds = 0.0
        # Async scheduling: the step launched on the device whose outputs are not in yet.
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.pending_step: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        self.num_overlapped_steps = 0  # launched while the step before was still running
        freeze_gc_heap()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.structured_output_manager.grammar_init(self.scheduler.add_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.pending_step is not None

    def get_stats(self) -> EngineCoreStats:
        manager = self.scheduler.kv_cache_manager
        return EngineCoreStats(
            num_gpu_blocks=manager.block_pool.num_blocks,
            num_free_blocks=manager.num_free_blocks,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_steps=self.num_steps,
            peak_num_blocks_used=self.peak_num_blocks_used,
            num_preemptions=self.scheduler.num_preemptions,
            busy_seconds=self.busy_seconds,
            **prefix_cache_stats(manager),
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (GPU and CPU tier); False, changing nothing, while requests run."""
        return self.scheduler.reset_prefix_cache()

    # --8<-- [start:step]
    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self.step_overlapped()
        if not self.scheduler.has_unfinished_requests():
            return []
        start = time.perf_counter()
        scheduler_output = self._schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.busy_seconds += time.perf_counter() - start
        return outputs
    # --8<-- [end:step]

    # --8<-- [start:step-overlapped]
    def step_overlapped(self) -> list[EngineCoreOutput]:
        """Async scheduling: launch step n+1, then finish step n, whose outputs are returned.

        The device runs step n while this thread schedules and prepares step n+1, which
        reads step n's sampled tokens on the device; only then does it wait for step n and
        hand its tokens to the scheduler. The host's work per step hides behind the device's.
        A request whose sampling needs its previous tokens on the host (penalties, min_tokens,
        a grammar) makes the core finish the pending step first: those steps do not overlap.
        """
        start = time.perf_counter()
        pending, launched = self.pending_step, None
        must_wait = pending is not None and self.scheduler.num_requests_needing_host_tokens > 0
        if self.scheduler.has_unfinished_requests() and not must_wait:
            scheduler_output = self._schedule()
            launched = (scheduler_output, self.executor.execute_model_async(scheduler_output))
            self.num_overlapped_steps += pending is not None
        outputs: list[EngineCoreOutput] = []
        if pending is not None:
            scheduler_output, runner_output = pending
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output.get_output())
        self.pending_step = launched
        self.busy_seconds += time.perf_counter() - start
        return outputs
    # --8<-- [end:step-overlapped]

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.structured_output_manager.grammar_bitmask(scheduler_output, self.scheduler.requests)
        self.last_scheduler_output = scheduler_output
        self.num_steps += 1
        manager = self.scheduler.kv_cache_manager
        self.peak_num_blocks_used = max(self.peak_num_blocks_used, manager.block_pool.num_blocks - manager.num_free_blocks)
        return scheduler_output

    def shutdown(self) -> None:
        if self.pending_step is not None:  # let the device finish before its memory goes
            self.pending_step[1].get_output()
            self.pending_step = None
        self.structured_output_manager.shutdown()
        self.executor.shutdown()

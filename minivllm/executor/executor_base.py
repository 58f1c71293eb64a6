"""`Executor`: what the engine core drives, whichever process the workers live in.

The engine core talks to "an executor" so that the same core can drive one worker in its own
process (`UniProcExecutor`) or one worker process per rank (`MultiProcExecutor`, the shape
tensor parallelism needs, chapter 10) without knowing which. Both reduce every call to one
primitive, vLLM's `collective_rpc`: run a named `Worker` method on every rank and collect the
answers. Chapter 05 (executor & worker).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from minivllm.config import EngineConfig
from minivllm.scheduler.output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput


# --8<-- [start:executor-base]
class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; the answers, in rank order."""

    def determine_num_available_blocks(self) -> int:
        # Every rank holds the same share of each layer's cache: the smallest answer fits all.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Every rank samples the same tokens (the same logits, the same seeds); rank 0 answers.
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the step and return at once (async scheduling; the in-process worker only)."""
        return self.collective_rpc("execute_model_async", (scheduler_output,))[0]

    def shutdown(self) -> None:
        """Stop the workers; the engine is unusable afterwards."""
# --8<-- [end:executor-base]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor `distributed_executor_backend` names: "uni" or "mp"."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from minivllm.executor.multiproc_executor import MultiProcExecutor

        return MultiProcExecutor
    from minivllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor

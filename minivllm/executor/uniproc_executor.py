"""`UniProcExecutor`: the executor for one device, running its worker in this process.

The engine core talks to "an executor" so that the same core can drive one worker here or
several worker processes (tensor parallelism, chapter 10) without knowing which. Chapter 05.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.executor.worker import Worker
from minivllm.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass  # nothing to stop: the worker lives and dies with this process

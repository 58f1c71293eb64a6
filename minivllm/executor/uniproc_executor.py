"""`UniProcExecutor`: the executor for one device, running its worker in this process.

`collective_rpc` is a plain method call on the one worker: no processes, no serialization.
It is the default, and what the offline engine uses. Chapter 05 (executor & worker).
"""

from __future__ import annotations

from typing import Any

from minivllm.config import EngineConfig
from minivllm.executor.executor_base import Executor
from minivllm.executor.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        pass  # nothing to stop: the worker lives and dies with this process

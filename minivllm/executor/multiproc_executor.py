"""`MultiProcExecutor`: one worker process per rank, driven over pipes.

This is the layout tensor parallelism needs (chapter 10): rank r's process owns device r, its
shard of the weights and its share of the KV cache. The engine core stays in its own process
and sends every rank the same message for each call — a broadcast of the pickled
`(method, args)`, e.g. `("execute_model", (scheduler_output,))` — then waits for one answer per
rank. That is vLLM's `collective_rpc`; vLLM broadcasts through a shared-memory ring buffer,
minivllm through one pipe per worker, which is simpler to read and fast enough for one
message per step.

A worker that dies (killed, out of memory, a crash in native code) must not leave the engine
waiting forever: while waiting, the executor also watches each process's sentinel, and a
process that ends turns into `EngineDeadError` naming the rank and its exit code.
Chapter 05 (executor & worker).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.exceptions import EngineDeadError
from minivllm.executor.executor_base import Executor

logger = logging.getLogger("minivllm")


# --8<-- [start:multiproc-executor]
class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.tensor_parallel_size
        self.is_dead = False
        # spawn, not fork: a forked child would inherit this process's CUDA state, which
        # CUDA does not support.
        context = multiprocessing.get_context("spawn")
        self.connections: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=worker_main, args=(config, rank, child_end), name=f"minivllm-worker-{rank}", daemon=True
            )
            process.start()
            child_end.close()  # the child holds its own copy; ours would hide the child's exit
            self.connections.append(parent_end)
            self.processes.append(process)
        self.worker_pids = self._gather("start-up")  # each worker answers once its model is loaded

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        if self.is_dead:
            raise EngineDeadError("a worker process died earlier; this engine cannot run any more")
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.connections:  # the broadcast: the same bytes to every rank
            conn.send_bytes(payload)
        return self._gather(method)

    def _gather(self, method: str) -> list[Any]:
        """One answer per rank, in rank order; a rank that dies first raises EngineDeadError."""
        answers: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self.connections))
        while pending:
            sentinels = {self.processes[rank].sentinel: rank for rank in pending}
            ready = wait(list(pending.values()) + list(sentinels))
            for item in ready:
                if item in sentinels:  # the process ended: maybe its last answer is still queued
                    rank = sentinels[item]
                    if rank in pending and not pending[rank].poll():
                        self._die(rank, method)
                    continue
                rank = next(r for r, c in pending.items() if c is item)
                try:
                    status, value = pending.pop(rank).recv()
                except (EOFError, OSError):
                    self._die(rank, method)
                if status == "error":
                    raise RuntimeError(f"worker rank {rank} failed in {method}:\n{value}")
                answers[rank] = value
        return answers

    def _die(self, rank: int, method: str) -> None:
        process = self.processes[rank]
        process.join(timeout=1.0)
        self.is_dead = True
        self.shutdown()
        raise EngineDeadError(
            f"worker process rank {rank} (pid {process.pid}) died with exit code {process.exitcode} "
            f"during {method}; the engine cannot continue"
        )

    def shutdown(self) -> None:
        for conn, process in zip(self.connections, self.processes):
            if process.is_alive():
                try:
                    conn.send_bytes(pickle.dumps(("shutdown", ())))
                except OSError:
                    pass
        for process in self.processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for conn in self.connections:
            conn.close()
        self.connections = []
        self.processes = []
# --8<-- [end:multiproc-executor]


# --8<-- [start:worker-main]
def worker_main(config: EngineConfig, rank: int, conn: Connection) -> None:
    """The body of a worker process: build the worker, then answer calls until told to stop."""
    from minivllm.executor.worker import Worker

    try:
        worker = Worker(config, rank)
        worker.load_model()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the executor's end closed: its process is gone
            return
        if method == "shutdown":
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
# --8<-- [end:worker-main]

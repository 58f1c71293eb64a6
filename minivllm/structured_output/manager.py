"""`StructuredOutputManager`: the engine core's side of structured output (chapter 11).

It does three jobs, as vLLM v1's manager of the same name does:

1. **Compile off the step loop.** `grammar_init` hands the request's spec to a thread pool and
   gives the request a future. Compiling a JSON schema against a 50k-token vocabulary takes
   milliseconds to seconds; the step loop must not stall for it, so the request waits
   (WAITING_FOR_FSM) and the scheduler skips it until the future is done.
2. **Cache.** Compiled grammars are kept by (kind, spec), so a schema that a thousand requests
   share is compiled once. A request that arrives while its spec is still compiling shares the
   same future.
3. **One bitmask per step.** `grammar_bitmask` fills one row per structured request that samples
   this step; the model runner applies the rows to the logits before sampling.

The tokenizer and xgrammar are loaded on the first structured request, in the pool's thread:
an engine that never sees one never loads them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from minivllm.config import EngineConfig
from minivllm.request import Request
from minivllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from minivllm.scheduler.output import SchedulerOutput
    from minivllm.structured_output.backend_xgrammar import XgrammarBackend

logger = logging.getLogger("minivllm")

# Compiled grammars kept, least recently used dropped first. A JSON-schema grammar takes from
# kilobytes to a few megabytes, so a few hundred fit easily.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Half the cores, at least one: compiling competes with the step loop for the CPU.
        self.executor = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="grammar")
        self.grammar_cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self.num_cache_hits = 0
        self.num_cache_misses = 0
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()

    # --8<-- [start:grammar-init]
    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse the cached one); never blocks."""
        so_request = request.structured_output_request
        if so_request is None:
            return
        key = (so_request.params.kind, so_request.params.spec)
        future = self.grammar_cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self.num_cache_hits += 1
            self.grammar_cache.move_to_end(key)
        else:
            self.num_cache_misses += 1
            future = self.executor.submit(self._compile, so_request.params)
            self.grammar_cache[key] = future
            if len(self.grammar_cache) > GRAMMAR_CACHE_SIZE:
                self.grammar_cache.popitem(last=False)  # requests holding it keep their own reference
        so_request.compiled_grammar = future
    # --8<-- [end:grammar-init]

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend.compile(params)

    @property
    def backend(self) -> XgrammarBackend:
        with self._backend_lock:  # the first compiles may start together, in several threads
            if self._backend is None:
                from minivllm.engine.llm_engine import load_tokenizer
                from minivllm.structured_output.backend_xgrammar import XgrammarBackend

                model_config = self.config.model_config
                tokenizer = load_tokenizer(self.config)
                if tokenizer is None:
                    raise ValueError("structured output needs the tokenizer, but skip_tokenizer_init=True")
                self._backend = XgrammarBackend(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
            return self._backend

    # --8<-- [start:grammar-bitmask]
    def grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Fill `scheduler_output`'s bitmask: one row per structured request sampled this step.

        A request samples this step when the step computes all its known tokens (its last
        prompt chunk, or a decode); a prompt chunk before the last samples nothing and needs
        no row. Unconstrained requests in the same batch get no row at all.
        """
        if scheduler_output.is_empty:
            self._wait_for_a_grammar()
            return
        rows: dict[str, int] = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            if request.structured_output_request is not None and request.num_computed_tokens >= request.num_tokens:
                rows[req_id] = len(rows)
        if not rows:
            return
        bitmask = self.backend.allocate_bitmask(len(rows))
        for req_id, row in rows.items():
            requests[req_id].structured_output_request.grammar.fill_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = bitmask
    # --8<-- [end:grammar-bitmask]

    def _wait_for_a_grammar(self, timeout: float = 0.01) -> None:
        """Nothing could run: rather than spin through empty steps, wait briefly for a compile."""
        compiling = [future for future in self.grammar_cache.values() if not future.done()]
        if compiling:
            wait(compiling, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

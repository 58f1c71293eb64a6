"""`LLMEngine`: the offline engine — front end (processor, output processor) + engine core.

`add_request` validates and tokenizes, `step` takes one engine-core step's outputs and turns
them into `RequestOutput`s. `LLM` drives it in a loop. Chapter 01 traces one request through
here. The core is reached through an `EngineCoreClient` (chapter 02): in this process by
default, or in a process of its own with MINIVLLM_ENABLE_MULTIPROCESSING=1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import EngineCoreClient, multiprocessing_enabled
from minivllm.engine.output_processor import OutputProcessor, ParentRequest
from minivllm.engine.processor import Processor, PromptType
from minivllm.engine.types import EngineCoreRequest, EngineCoreStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


def load_tokenizer(config: EngineConfig) -> Any | None:
    if config.model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(config.model_config.tokenizer)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot load a tokenizer from {config.model_config.tokenizer!r} ({err}); "
            "pass tokenizer=... or skip_tokenizer_init=True with token-id prompts"
        ) from err


@dataclass
class PreparedRequest:
    """A validated user request: one engine-core request, or n children when n > 1."""

    request_id: str  # the id the user sees in RequestOutput
    prompt: str | None
    core_requests: list[EngineCoreRequest]
    parent: ParentRequest | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess_mode: bool = False) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(multiprocess_mode, asyncio_mode=False, config=config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, enable_multiprocessing: bool | None = None) -> LLMEngine:
        """`enable_multiprocessing=None`: as MINIVLLM_ENABLE_MULTIPROCESSING says (default off)."""
        return cls(engine_args.create_engine_config(), multiprocess_mode=multiprocessing_enabled(enable_multiprocessing))

    # --8<-- [start:add-request]
    def prepare_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> PreparedRequest:
        """Validate and tokenize; a request with n > 1 becomes n child requests (vLLM's fan-out).

        Raises ValueError on bad input, having changed nothing.
        """
        request, prompt_text = self.processor.process_inputs(request_id, prompt, params, arrival_time)
        if request.sampling_params.n == 1:
            return PreparedRequest(request_id, prompt_text, [request])
        parent = ParentRequest(request_id, request.sampling_params.n)
        children = []
        for index in range(parent.n):
            child_params = request.sampling_params.clone()
            child_params.n = 1
            if child_params.seed is not None:
                child_params.seed += index  # distinct but reproducible samples, as vLLM does
            children.append(
                EngineCoreRequest(
                    f"{index}_{request_id}", request.prompt_token_ids, child_params, request.arrival_time,
                    cache_salt=request.cache_salt,
                )
            )
        return PreparedRequest(request_id, prompt_text, children, parent)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        for index, request in enumerate(prepared.core_requests):
            self.output_processor.add_request(request, prepared.prompt, prepared.parent, index)
            self.engine_core.add_request(request)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))
    # --8<-- [end:add-request]

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    # --8<-- [start:engine-step]
    def step(self) -> list[RequestOutput]:
        if not self.has_unfinished_requests():
            return []  # with the core in another process, waiting for outputs would never end
        # In-process this runs one EngineCore.step(); otherwise it waits for the outputs of
        # the next step the core process ran on its own.
        engine_core_outputs = self.engine_core.get_output()
        for failed in (out for out in engine_core_outputs if out.error is not None):
            logger.error("request %s failed in the engine core: %s", failed.request_id, failed.error)
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(engine_core_outputs)
        # Stop strings are found here, in the front end; tell the core to stop those requests.
        self.engine_core.abort_requests(reqs_to_abort)
        return request_outputs
    # --8<-- [end:engine-step]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    def get_stats(self) -> EngineCoreStats:
        """Blocks, steps, queues of the core, in either mode (a utility call when it is remote)."""
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (chapter 04); False, changing nothing, while requests run."""
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine core (and its process, if it has one)."""
        self.engine_core.shutdown()

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("the tokenizer was not loaded (skip_tokenizer_init=True)")
        return self.tokenizer

"""`AsyncLLM`: the streaming front end, under vLLM's name and API (chapter 02).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for output in engine.generate(prompt, SamplingParams(output_kind=DELTA), "req-1"):
        print(output.outputs[0].text, end="")

The engine core always runs in its own process here (`AsyncMPClient`). This process does the
text work: `generate` tokenizes and validates (the same `Processor` as `LLM`), and one
*output handler* task turns each batch of core outputs into `RequestOutput`s with the same
`OutputProcessor` (incremental detokenization, stop strings, logprobs), then fans them out to
one `RequestOutputCollector` per request. Each `generate` stream waits on its own collector, so
thousands of concurrent streams cost one small object each, and a slow consumer never holds up
the others: its DELTA outputs merge while it is away.

A consumer that goes away (its task cancelled, or the generator closed) aborts its request in
the core, which frees the request's KV blocks. A request the core refuses fails alone
(`EngineGenerateError` in its stream); if the core process dies, every stream and every later
call raise `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import CoreAddresses, EngineCoreClient
from minivllm.engine.exceptions import EngineDeadError, EngineGenerateError
from minivllm.engine.llm_engine import LLMEngine, load_tokenizer
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.processor import Processor, PromptType
from minivllm.engine.types import EngineCoreOutput, EngineCoreStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

# Core outputs processed between two yields to the event loop, so that streams get to run
# while a large batch is detokenized (vLLM: VLLM_V1_OUTPUT_PROC_CHUNK_SIZE, also 128).
OUTPUT_CHUNK_SIZE = 128


# --8<-- [start:collector]
class RequestOutputCollector:
    """One request's mailbox between the output handler and its `generate()` stream.

    At most one item waits in it. If the consumer falls behind, a DELTA output merges into the
    waiting one (nothing is lost, and the stream catches up in one read); any other kind
    replaces it (the newest CUMULATIVE output holds everything). An exception always wins.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):  # the consumer has not read the last one yet
            if self.aggregate:
                merge_delta_output(self.output, output)
            else:
                self.output = output

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output
# --8<-- [end:collector]


# --8<-- [start:merge-delta]
# exercise[ch02-merge-delta]: per completion index: append text, token ids, logprobs; take the newest finish/stop/cumulative; add new indices
def merge_delta_output(pending: RequestOutput, new: RequestOutput) -> None:
    """Fold `new`, a DELTA output of the same request, into `pending`, which nobody has read yet.

    Afterwards `pending` reads as if the two deltas had been one: for each completion of `new`
    (matched to `pending`'s by `CompletionOutput.index`; with n > 1 a delta may carry a
    completion `pending` does not have yet, which is then appended), `text` and `token_ids`
    are appended, and `logprobs` too when present; `cumulative_logprob`, `finish_reason`
    and `stop_reason` are the newer ones. `pending.finished` and `pending.metrics` become
    `new`'s. `pending` is changed in place; `new` is not changed.
    """
    pending.finished = new.finished
    pending.metrics = new.metrics
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            pending.outputs.append(completion)
            continue
        old.text += completion.text
        old.token_ids = old.token_ids + completion.token_ids
        if completion.logprobs is not None:
            old.logprobs = (old.logprobs or []) + completion.logprobs
        old.cumulative_logprob = completion.cumulative_logprob
        old.finish_reason, old.stop_reason = completion.finish_reason, completion.stop_reason
# --8<-- [end:merge-delta]


# --8<-- [start:fan-out]
# exercise[ch02-fan-out]: put each output into collectors[output.request_id]; skip ids with no collector; delete the entry once finished
def fan_out(request_outputs: list[RequestOutput], collectors: dict[str, RequestOutputCollector]) -> None:
    """Deliver each output to the collector of its request (`collectors[output.request_id]`).

    A request whose output is `finished` gets nothing more: remove its collector from
    `collectors` once the output is in it. An output for a request with no collector (its
    consumer went away, or it was aborted) is dropped.
    """
    for output in request_outputs:
        collector = collectors.get(output.request_id)
        if collector is None:
            continue
        collector.put(output)
        if output.finished:
            del collectors[output.request_id]
# --8<-- [end:fan-out]


class AsyncLLM:
    """Streams `RequestOutput`s for many concurrent requests; the core runs in its own process."""

    # The same validation, tokenization and n > 1 fan-out as the offline engine.
    prepare_request = LLMEngine.prepare_request

    def __init__(self, config: EngineConfig, attach_to: CoreAddresses | None = None) -> None:
        """Start an engine core process, or, with `attach_to`, use one that several API server
        processes share (`minivllm serve --api-server-count`, chapter 11)."""
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(
            multiprocess_mode=True, asyncio_mode=True, config=config, attach_to=attach_to
        )
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.output_handler: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("the tokenizer was not loaded (skip_tokenizer_init=True)")
        return self.tokenizer

    # --8<-- [start:generate]
    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs, as `sampling_params.output_kind` says, until it finishes."""
        collector = None
        try:
            collector = await self.add_request(request_id, prompt, sampling_params)
            finished = False
            while not finished:
                output = collector.get_nowait() or await collector.get()  # no await if one waits
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if collector is not None:  # the consumer went away: stop the request in the core too
                self.collectors.pop(request_id, None)
                await self.abort(request_id)
            raise
    # --8<-- [end:generate]

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestOutputCollector:
        """Validate and send a request; its outputs will arrive in the returned collector."""
        self._ensure_alive()
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        prepared = self.prepare_request(request_id, prompt, params, arrival_time)  # ValueError: nothing sent
        collector = RequestOutputCollector(params.output_kind)
        self.collectors[request_id] = collector
        self._ensure_output_handler()
        try:
            for index, request in enumerate(prepared.core_requests):
                self.output_processor.add_request(request, prepared.prompt, prepared.parent, index)
                await self.engine_core.add_request_async(request)
        except BaseException:
            self.collectors.pop(request_id, None)
            core_ids = self.output_processor.abort_requests([request_id])
            if not self.errored:
                await self._abort_in_core(core_ids)
            raise
        return collector

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests: their streams end with a finished output (finish_reason "abort")."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self._core_request_ids(request_ids)
        aborted = [EngineCoreOutput(core_id, [], finish_reason="abort") for core_id in core_ids]
        request_outputs, _ = self.output_processor.process_outputs(aborted)
        fan_out(request_outputs, self.collectors)
        await self._abort_in_core(core_ids)

    async def get_stats(self) -> EngineCoreStats:
        """The core's block, queue and step counts, answered between two of its steps."""
        self._ensure_alive()
        return await self.engine_core.get_stats_async()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (chapter 04); False while requests hold blocks."""
        self._ensure_alive()
        return await self.engine_core.reset_prefix_cache_async()

    def shutdown(self) -> None:
        """Stop the core process; streams still waiting raise EngineDeadError."""
        if self.output_handler is not None and not self.output_handler.done():
            try:
                self.output_handler.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        self._fail_all_streams(EngineDeadError("the engine was shut down"))
        self.engine_core.shutdown()

    # --8<-- [start:output-handler]
    async def _run_output_handler(self) -> None:
        """One task for the whole engine: core outputs → OutputProcessor → per-request collectors."""
        try:
            while True:
                # Every step that arrived while the streams ran, oldest first: when this
                # process falls behind the core, a stream gets one event for several tokens.
                outputs = await self.engine_core.get_output_async()
                outputs += self.engine_core.get_ready_outputs()
                for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
                    if start:
                        await asyncio.sleep(0)  # let the streams run between chunks
                    chunk, failed_ids = self._fail_refused_requests(outputs[start : start + OUTPUT_CHUNK_SIZE])
                    request_outputs, reqs_to_abort = self.output_processor.process_outputs(chunk)
                    fan_out(request_outputs, self.collectors)
                    # Stop strings end requests here, in the front end: the core must drop them too.
                    await self.engine_core.abort_requests_async(reqs_to_abort + failed_ids)
        except Exception as err:  # the core died (or, a bug here): no stream can go on
            self.dead_error = err if isinstance(err, EngineDeadError) else EngineDeadError(f"output handler failed: {err!r}")
            self._fail_all_streams(self.dead_error)
    # --8<-- [end:output-handler]

    def _fail_refused_requests(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[str]]:
        """Raise the core's per-request errors in their own streams; return the other outputs,
        and the core ids of the failed requests' n > 1 siblings, which must be aborted."""
        passed, to_abort = [], []
        for out in outputs:
            if out.error is None:
                passed.append(out)
                continue
            state = self.output_processor.request_states.get(out.request_id)
            if state is None:
                continue
            request_id = state.parent.request_id if state.parent is not None else out.request_id
            to_abort += [i for i in self.output_processor.abort_requests([request_id]) if i != out.request_id]
            collector = self.collectors.pop(request_id, None)
            if collector is not None:
                collector.put(EngineGenerateError(f"request {request_id!r} failed in the engine core: {out.error}"))
        return passed, to_abort

    def _core_request_ids(self, request_ids: list[str]) -> list[str]:
        """The core's ids for these user requests: the id itself, or the children of n > 1."""
        states = self.output_processor.request_states
        core_ids = []
        for request_id in request_ids:
            if request_id in self.output_processor.parents:
                core_ids += [cid for cid, s in states.items() if s.parent is not None and s.parent.request_id == request_id]
            elif request_id in states:
                core_ids.append(request_id)
        return core_ids

    async def _abort_in_core(self, core_ids: list[str]) -> None:
        if core_ids and not self.errored:
            try:
                await self.engine_core.abort_requests_async(core_ids)
            except EngineDeadError:
                pass  # a dead core holds no requests

    def _ensure_output_handler(self) -> None:
        if self.output_handler is None:
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    def _ensure_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def _fail_all_streams(self, err: EngineDeadError) -> None:
        for collector in self.collectors.values():
            collector.put(EngineDeadError(str(err)))
        self.collectors.clear()

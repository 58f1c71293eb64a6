"""What the completion and chat endpoints share (chapter 11): vLLM's `OpenAIServing`.

A request body becomes `SamplingParams` here (`build_sampling_params`), after the two checks
that need the prompt's length (`resolve_max_tokens`); structured-output fields from three
generations of the API become one `StructuredOutputsParams`. `generate` runs one engine
request, feeds the latency metrics, and aborts the request if its consumer goes away.
`sse_events` is the wire format of every stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.errors import OpenAIError, error_body, status_of
from minivllm.entrypoints.openai.protocol import SamplingFields
from minivllm.metrics import ServerMetrics
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


# --8<-- [start:resolve-max-tokens]
# exercise[ch11-validate-max-tokens]: prompt must leave room for one token; None → what is left; < 1 or too many → ValueError naming both lengths
def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens the request may generate; a ValueError (→ HTTP 400) if it cannot be served.

    The prompt and the output together must fit in `max_model_len` tokens:
    - a prompt of `max_model_len` tokens or more leaves no room: ValueError;
    - `requested` None means "as many as fit": `max_model_len - num_prompt_tokens`;
    - `requested` < 1 is a ValueError, and so is a `requested` that does not fit with the
      prompt. Each message names the numbers involved, so the client can fix its request.
    """
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room for output"
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested < 1:
        raise ValueError(f"max_tokens must be at least 1, got {requested}")
    if requested > room:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but you asked for "
            f"{num_prompt_tokens + requested} ({num_prompt_tokens} in the prompt, {requested} to generate)"
        )
    return requested
# --8<-- [end:resolve-max-tokens]


# --8<-- [start:sse-events]
# exercise[ch11-sse-stream]: "data: " + JSON + blank line per chunk; an exception becomes one error chunk; always finish with "data: [DONE]"
async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events for a stream of response chunks, as OpenAI sends them.

    Each chunk (a JSON-able dict) becomes one event: the line `data: <the chunk as JSON>`
    followed by a blank line. When `chunks` raises an `Exception` midway, the headers (200)
    are long gone, so the failure travels as one more event holding OpenAI's error object,
    `error_body(str(err), status_of(err))`. Either way the stream ends with `data: [DONE]`
    and a blank line, which is how clients know it is complete. (A cancellation, which is a
    `BaseException`, is not an error to report: the client is gone.)
    """
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as err:
        yield f"data: {json.dumps(error_body(str(err), status_of(err)))}\n\n"
    yield "data: [DONE]\n\n"
# --8<-- [end:sse-events]


class OpenAIServing:
    """The engine, the names it is served under, and the helpers every endpoint uses."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_model_len = engine.config.model_config.max_model_len
        self.tokenizer = engine.tokenizer  # None with --skip-tokenizer-init: token-id prompts only
        self.metrics = metrics
        self._abort_tasks: set[asyncio.Task] = set()

    def require_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, but this server runs with --skip-tokenizer-init: send token ids")

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve (None: the first)."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(f"the model `{model}` does not exist; this server serves {self.served_model_names}", 404, "model")
        return model

    # --8<-- [start:build-sampling-params]
    def build_sampling_params(
        self, request: SamplingFields, max_tokens: int | None, num_prompt_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """Body fields → SamplingParams; every bad value is a ValueError (→ 400) naming the field."""
        request.warn_unknown_fields()
        optional = {  # None in the body means "the engine's default"
            name: getattr(request, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
            if getattr(request, name) is not None
        }
        return SamplingParams(
            n=request.n, seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, min_tokens=request.min_tokens, logprobs=logprobs,
            max_tokens=resolve_max_tokens(max_tokens, num_prompt_tokens, self.max_model_len),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            detokenize=self.tokenizer is not None,
            structured_outputs=structured_outputs_from_request(request),
            # The server always streams deltas from the engine, even to build one response.
            output_kind=RequestOutputKind.DELTA,
            **optional,
        )
    # --8<-- [end:build-sampling-params]

    # --8<-- [start:generate]
    async def generate(self, prompt: dict[str, Any], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """One engine request's DELTA outputs, observed by the metrics; aborted if abandoned."""
        observer = self.metrics.observe_request(len(prompt["prompt_token_ids"])) if self.metrics else None
        finished = False
        try:
            async for output in self.engine.generate(prompt, params, request_id):
                finished = output.finished
                if observer is not None:
                    observer.on_output(output)
                yield output
        finally:
            if not finished:
                # The client went away (or the stream failed). Abort in a task of its own: this
                # code may be running inside a cancelled scope where any await is cancelled.
                task = asyncio.get_running_loop().create_task(self.engine.abort(request_id))
                self._abort_tasks.add(task)
                task.add_done_callback(self._abort_tasks.discard)
    # --8<-- [end:generate]


def structured_outputs_from_request(request: SamplingFields):  # -> StructuredOutputsParams | None
    """One `StructuredOutputsParams` from OpenAI's `response_format`, vLLM's `structured_outputs`,
    or the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""
    from minivllm.sampling_params import StructuredOutputsParams

    found: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if request.structured_outputs is not None:
        fields = {k: v for k, v in request.structured_outputs.items() if v is not None}
        unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}")
        found.append(("structured_outputs", fields))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"give one structured-output constraint, got {[name for name, _ in found]}")
    try:
        return StructuredOutputsParams(**found[0][1])
    except ValueError as err:
        raise ValueError(f"{found[0][0]}: {err}") from None


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except BaseException as err:  # hand it to the reader, who re-raises it
            await queue.put((index, err))
            return
        await queue.put((index, done))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:  # cancelling a drain runs its stream's clean-up (the abort)
            task.cancel()

"""`POST /v1/completions`: prompts in, text out, whole or streamed (chapter 11).

A body may carry one prompt or several (strings or token ids); each runs as its own engine
request, and with `n` > 1 each of those runs n completions. Choice `i * n + j` is completion
`j` of prompt `i`, as in OpenAI's API. Streams from several prompts are merged as their
tokens arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from minivllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing, merge_streams
from minivllm.outputs import CompletionOutput, SampleLogprobs


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, request: CompletionRequest) -> tuple[str, list[dict[str, Any]], list[Any]]:
        """Check the body and start its engine requests; bad input raises before anything runs."""
        model = self.check_model(request.model)
        prompts = self.normalize_prompts(request.prompt)
        params = [
            self.build_sampling_params(request, request.max_tokens, len(p["prompt_token_ids"]), request.logprobs)
            for p in prompts
        ]
        request_id = random_id("cmpl")
        streams = [self.generate(p, sp, f"{request_id}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        # Take each stream's first output now: validation in the engine's front end (the
        # Processor) runs on the first step of the stream, and its ValueError must become a
        # 400 before any response header is sent.
        firsts = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
        failures = [f for f in firsts if isinstance(f, BaseException)]
        if failures:
            for stream in streams:
                await stream.aclose()
            raise failures[0]
        return model, prompts, [_prepend(first, stream) for first, stream in zip(firsts, streams)]

    def normalize_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict[str, Any]]:
        """Every prompt form → {"prompt": text or None, "prompt_token_ids": ids}."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        out = []
        for p in prompt:
            if isinstance(p, str):
                self.require_tokenizer("a text prompt")
                out.append({"prompt": p, "prompt_token_ids": self.tokenizer.encode(p)})
            else:
                out.append({"prompt_token_ids": list(p)})
        return out

    async def full_response(self, request: CompletionRequest) -> CompletionResponse:
        model, prompts, streams = await self.prepare(request)
        n = request.n
        completions: dict[int, CompletionOutput] = {}
        async for prompt_index, output in merge_streams(streams):
            for delta in output.outputs:
                index = prompt_index * n + delta.index
                if index not in completions:
                    completions[index] = delta
                else:
                    _append(completions[index], delta)
        choices = []
        for index in sorted(completions):
            completion = completions[index]
            prompt = prompts[index // n]
            text = completion.text
            logprobs = self.completion_logprobs(completion.logprobs, 0) if request.logprobs is not None else None
            if request.echo:
                prompt_text = self.prompt_text(prompt)
                text = prompt_text + text
                if logprobs is not None:
                    logprobs = self.echo_logprobs(prompt["prompt_token_ids"], logprobs)
            choices.append(CompletionChoice(
                index=index, text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if request.return_token_ids else None,
            ))
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        num_generated = sum(len(c.token_ids) for c in completions.values())
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated, total_tokens=num_prompt_tokens + num_generated)
        return CompletionResponse(model=model, choices=choices, usage=usage)

    async def stream_chunks(self, request: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        """Validate and start now; the returned iterator yields the stream's chunks."""
        model, prompts, streams = await self.prepare(request)
        return self._chunks(request, model, prompts, streams)

    async def _chunks(self, request: CompletionRequest, model: str, prompts: list[dict[str, Any]], streams: list[Any]) -> AsyncIterator[dict[str, Any]]:
        response_id, created, n = random_id("cmpl"), CompletionResponse(model=model, choices=[]).created, request.n
        echoed: set[int] = set()
        text_offsets: dict[int, int] = {}
        num_generated = 0
        async for prompt_index, output in merge_streams(streams):
            for delta in output.outputs:
                index = prompt_index * n + delta.index
                text = delta.text
                if request.echo and index not in echoed:
                    echoed.add(index)
                    text = self.prompt_text(prompts[prompt_index]) + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(delta.logprobs, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                num_generated += len(delta.token_ids)
                # CompletionChoice's fields as a plain dict: this runs for every event of every
                # stream, and a pydantic model plus model_dump() would cost more than the rest.
                choice = {
                    "index": index, "text": text, "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                    "token_ids": list(delta.token_ids) if request.return_token_ids else None,
                }
                yield {"id": response_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]}
        if request.stream_options is not None and request.stream_options.include_usage:
            num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated, total_tokens=num_prompt_tokens + num_generated)
            yield {"id": response_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage.model_dump()}

    def prompt_text(self, prompt: dict[str, Any]) -> str:
        text = prompt.get("prompt")
        if text is None and self.tokenizer is None:
            return ""  # no tokenizer, no text: the token ids are all there is
        return text if text is not None else self.tokenizer.decode(prompt["prompt_token_ids"])

    def completion_logprobs(self, logprobs: SampleLogprobs | None, start_offset: int) -> CompletionLogprobs:
        """vLLM's logprobs dicts → OpenAI's legacy `logprobs` object of the completions API."""
        result = CompletionLogprobs()
        offset = start_offset
        for position in logprobs or []:
            sampled_id, sampled = next(iter(position.items()))  # the sampled token comes first
            token = sampled.decoded_token if sampled.decoded_token is not None else str(sampled_id)
            result.tokens.append(token)
            result.token_logprobs.append(sampled.logprob)
            result.top_logprobs.append({
                (lp.decoded_token if lp.decoded_token is not None else str(tid)): lp.logprob for tid, lp in position.items()
            })
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def echo_logprobs(self, prompt_token_ids: list[int], generated: CompletionLogprobs) -> CompletionLogprobs:
        """Echoed prompt tokens come first, without logprobs (minivllm computes no prompt logprobs)."""
        tokens = [self.tokenizer.decode([t]) if self.tokenizer is not None else str(t) for t in prompt_token_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens + generated.tokens,
            token_logprobs=[None] * len(tokens) + generated.token_logprobs,
            top_logprobs=[None] * len(tokens) + generated.top_logprobs,
            text_offset=offsets + [o + offset for o in generated.text_offset],
        )


async def _prepend(first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in stream:
        yield item


def _append(completion: CompletionOutput, delta: CompletionOutput) -> None:
    completion.text += delta.text
    completion.token_ids = completion.token_ids + delta.token_ids
    if delta.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + delta.logprobs
    completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason

"""`POST /v1/chat/completions`: a conversation through the model's chat template (chapter 11).

The messages become one prompt with `chat_prompt` (the same function as `LLM.chat`), and from
there the request is a completion like any other. Streams follow OpenAI's chunk shape: a
first delta with the role, then content deltas, the finish reason on the last delta of each
choice, and, when asked, a usage chunk with no choices.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from minivllm.entrypoints.llm import chat_prompt
from minivllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.outputs import RequestOutput, SampleLogprobs


class OpenAIServingChat(OpenAIServing):
    def render_prompt(self, request: ChatCompletionRequest | Any) -> dict[str, Any]:
        """The conversation as a prompt: text and token ids, through the chat template."""
        self.require_tokenizer("a chat request")
        conversation = [{"role": m.role, "content": _text_of(m.content)} for m in request.messages]
        try:
            return chat_prompt(
                self.tokenizer, conversation, getattr(request, "chat_template", None), request.add_generation_prompt
            )
        except Exception as err:  # a template that rejects the conversation (jinja2 errors) is the client's
            raise ValueError(f"the chat template could not render these messages: {err}") from None

    async def prepare(self, request: ChatCompletionRequest) -> tuple[str, dict[str, Any], AsyncIterator[RequestOutput], RequestOutput]:
        model = self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        prompt = self.render_prompt(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.build_sampling_params(request, max_tokens, len(prompt["prompt_token_ids"]), num_logprobs)
        stream = self.generate(prompt, params, random_id("chatcmpl"))
        first = await anext(stream)  # the engine's validation errors become 400s here
        return model, prompt, stream, first

    async def full_response(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        model, prompt, stream, first = await self.prepare(request)
        texts: dict[int, str] = {}
        token_counts: dict[int, int] = {}
        logprobs: dict[int, SampleLogprobs] = {}
        finish: dict[int, tuple[str | None, int | str | None]] = {}
        output: RequestOutput | None = first
        while output is not None:
            for delta in output.outputs:
                texts[delta.index] = texts.get(delta.index, "") + delta.text
                token_counts[delta.index] = token_counts.get(delta.index, 0) + len(delta.token_ids)
                logprobs.setdefault(delta.index, []).extend(delta.logprobs or [])
                finish[delta.index] = (delta.finish_reason, delta.stop_reason)
            output = await anext(stream, None)
        choices = [
            ChatChoice(
                index=i, message=AssistantMessage(content=texts[i]),
                logprobs=self.chat_logprobs(logprobs[i], request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=finish[i][0], stop_reason=finish[i][1],
            )
            for i in sorted(texts)
        ]
        num_prompt_tokens, num_generated = len(prompt["prompt_token_ids"]), sum(token_counts.values())
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated, total_tokens=num_prompt_tokens + num_generated)
        return ChatCompletionResponse(model=model, choices=choices, usage=usage)

    async def stream_chunks(self, request: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        model, prompt, stream, first = await self.prepare(request)
        return self._chunks(request, model, prompt, stream, first)

    async def _chunks(
        self, request: ChatCompletionRequest, model: str, prompt: dict[str, Any], stream: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[dict[str, Any]]:
        response_id, created = random_id("chatcmpl"), ChatCompletionResponse(model=model, choices=[]).created

        def chunk(choice: dict[str, Any] | None, usage: UsageInfo | None = None) -> dict[str, Any]:
            return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice] if choice is not None else [],
                    **({"usage": usage.model_dump()} if usage is not None else {})}

        for index in range(request.n):  # OpenAI opens every choice with the role
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")).model_dump())
        num_generated = 0
        output: RequestOutput | None = first
        while output is not None:
            for delta in output.outputs:
                num_generated += len(delta.token_ids)
                logprobs = self.chat_logprobs(delta.logprobs or [], request.top_logprobs or 0) if request.logprobs else None
                # ChatStreamChoice's fields as a plain dict: this runs for every event.
                yield chunk({
                    "index": delta.index, "delta": {"role": None, "content": delta.text},
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                })
            output = await anext(stream, None)
        if request.stream_options is not None and request.stream_options.include_usage:
            num_prompt_tokens = len(prompt["prompt_token_ids"])
            yield chunk(None, UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                                        total_tokens=num_prompt_tokens + num_generated))

    def chat_logprobs(self, logprobs: SampleLogprobs, top_k: int) -> ChatLogprobs:
        """vLLM's logprobs dicts → the chat API's `logprobs.content` list."""
        content = []
        for position in logprobs:
            sampled_id, sampled = next(iter(position.items()))  # the sampled token comes first
            top = sorted(((lp.rank or 0, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_k))
            content.append(TokenLogprob(
                token=_token_text(sampled_id, sampled.decoded_token), logprob=sampled.logprob,
                bytes=list(_token_text(sampled_id, sampled.decoded_token).encode()),
                top_logprobs=[
                    TopLogprob(token=_token_text(tid, lp.decoded_token), logprob=lp.logprob, bytes=list(_token_text(tid, lp.decoded_token).encode()))
                    for _, tid, lp in top
                ],
            ))
        return ChatLogprobs(content=content)


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [part.get("text", "") for part in content if part.get("type") == "text"]
    if len(parts) != len(content):
        raise ValueError("only text message parts are supported (this server has no multimodal input)")
    return "".join(parts)


def _token_text(token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else f"token_id:{token_id}"

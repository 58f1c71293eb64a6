"""Request and response bodies of the OpenAI API, as pydantic models (chapter 11).

Field names and defaults follow OpenAI's API and vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `structured_outputs`, the older `guided_*`
fields), so a client written for either works unchanged.

Unknown fields are accepted and ignored, with a warning in the server log naming them, as
vLLM does: OpenAI adds fields often, and a client library that sends a new one should not
break. A known field with a bad value is a 400 (see `errors.py`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

MAX_N = 128  # OpenAI's own limit on `n`
INT32_MAX = 2**31 - 1  # integer fields become int32/int64 tensors in the engine: keep them in range


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # extra="allow": unknown fields land in `model_extra`, which `warn_unknown_fields` reports.
    # allow_inf_nan=False: a NaN temperature would pass every range check and poison sampling.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def warn_unknown_fields(self) -> list[str]:
        unknown = sorted(self.model_extra or {})
        if unknown:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
        return unknown


# -- requests ------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIBaseModel):
    """The fields completions and chat share: how to sample, when to stop, what to constrain."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # what torch.Generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | list[list[Annotated[int, Field(ge=0, le=INT32_MAX)]]]
    max_tokens: int | None = Field(default=16, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids


class ChatMessage(OpenAIBaseModel):
    role: str
    # A string, or a list of parts of which the text parts are used: [{"type": "text", "text": ...}].
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    add_generation_prompt: bool = True
    chat_template: str | None = None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


# -- responses -----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]

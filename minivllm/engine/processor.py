"""`Processor`: user input → a validated, tokenized `EngineCoreRequest`.

Everything that can be wrong with a request is caught here, before the engine sees it: an
empty or too-long prompt, token ids outside the vocabulary, sampling parameters the engine
cannot honour, a JSON schema or grammar that does not compile. The error is a `ValueError`
that names the problem; the engine and the other requests are untouched. Chapter 01 shows where this sits on the request path.
"""

from __future__ import annotations

import time
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import validate_structured_outputs

# Prompt forms accepted, as in vLLM: a string, {"prompt": str}, {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class Processor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.model_config = config.model_config
        self.tokenizer = tokenizer

    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> tuple[EngineCoreRequest, str | None]:
        """Return the engine request and the prompt text (None when given as token ids)."""
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        params = self._finalize_params(params, len(prompt_token_ids))
        request = EngineCoreRequest(
            request_id, prompt_token_ids, params, arrival_time or time.time(), cache_salt=_cache_salt(prompt)
        )
        return request, prompt_text

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init=True: pass prompt_token_ids")
        return text, self.tokenizer.encode(text)

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        max_model_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(
                f"the prompt (length {len(prompt_token_ids)}) is longer than the maximum model "
                f"length of {max_model_len}"
            )
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {vocab_size})")

    def _finalize_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs} is more than the maximum of {MAX_LOGPROBS}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True")
        if params.structured_outputs is not None:
            # Build the grammar now: a bad schema, regex or grammar is this request's ValueError.
            validate_structured_outputs(params.structured_outputs, self.tokenizer)
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = max(1, self.model_config.max_model_len - num_prompt_tokens)
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= set(self.model_config.eos_token_ids)
        return params


def _cache_salt(prompt: PromptType) -> str | None:
    """`{"prompt": ..., "cache_salt": "..."}`: prefix-cache isolation, as vLLM spells it (chapter 04)."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt

"""`POST /tokenize` and `POST /detokenize`: the server's tokenizer, as vLLM exposes it (chapter 11).

Useful to count a prompt's tokens before sending it (is it under `max_model_len`?) and to
read token ids back as text. A chat request's messages are rendered through the chat
template first, exactly as `/v1/chat/completions` would.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.require_tokenizer("/tokenize")
        request.warn_unknown_fields()
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if request.messages is not None:
            token_ids = self.render_prompt(request)["prompt_token_ids"]
        else:
            token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": self.max_model_len}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.require_tokenizer("/detokenize")
        vocab_size = self.engine.config.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {vocab_size})")
        return {"prompt": self.tokenizer.decode(request.tokens)}

"""`LLM`: vLLM's offline API — `LLM(model).generate(prompts, sampling_params)`.

It builds an `LLMEngine`, adds every prompt, and steps the engine until all are finished:
continuous batching does the rest. Outputs come back in the order of the prompts.
Chapter 01 starts here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processor import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An offline engine over one model. `model=None` loads the embedded demo model.

    `enable_multiprocessing=True` runs the engine core in a process of its own (chapter 02);
    None (the default) follows MINIVLLM_ENABLE_MULTIPROCESSING, which is off unless set to 1.
    """

    def __init__(self, model: str | None = None, *, enable_multiprocessing: bool | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args, enable_multiprocessing=enable_multiprocessing)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (chapter 04), as vLLM's `LLM.reset_prefix_cache`.

        Returns False, changing nothing, while requests still hold blocks.
        """
        return self.llm_engine.reset_prefix_cache()

    # --8<-- [start:generate]
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params: give one, or one per prompt")
        # Validate every prompt before adding any, so a bad one leaves the engine untouched.
        engine = self.llm_engine
        prepared = [
            engine.prepare_request(str(next(self._request_counter)), prompt, params)
            for prompt, params in zip(prompts, params_list)
        ]
        for request in prepared:
            # generate() returns only finished outputs: the engine need not build the
            # intermediate ones (a copy of every request's tokens, every step).
            for core_request in request.core_requests:
                core_request.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_prepared(request)
        return self._run_engine([r.request_id for r in prepared], use_tqdm)
    # --8<-- [end:generate]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            chat_prompt(tokenizer, conversation, chat_template, add_generation_prompt) for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # --8<-- [start:run-engine]
    # exercise[ch01-run-engine]: while engine.has_unfinished_requests(): keep each finished output of engine.step() by its request_id; return them in request_ids' order
    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until no request is left; return each request's final output, in
        the order of `request_ids`.

        `self.llm_engine.step()` runs one step and returns the outputs of the requests it
        advanced; only those with `finished` set are final. Requests finish in any order (a
        short one before a long one), so keep them by `request_id`. With `use_tqdm`, a
        progress bar counts the finished requests.
        """
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_output_tokens = 0
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output {num_output_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} toks/s")
        bar.close()
        return [finished[request_id] for request_id in request_ids]
    # --8<-- [end:run-engine]


def chat_prompt(
    tokenizer: Any, conversation: ChatMessages, chat_template: str | None = None, add_generation_prompt: bool = True
) -> dict[str, Any]:
    """A conversation → a prompt, through the model's chat template."""
    text = tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    # The template already wrote the special tokens; don't let the tokenizer add more.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

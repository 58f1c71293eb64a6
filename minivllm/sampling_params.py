"""`SamplingParams`: how one request picks its next tokens and when it stops.

The names and defaults follow vLLM's `SamplingParams`, so code written for vLLM runs here.
Validation happens at construction: a bad value is a `ValueError` that names the field, raised
before the request reaches the engine, so one bad request never disturbs the others.

Chapter 01 (architecture) shows where these travel; the sampler that obeys them is
`minivllm/sample/sampler.py`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

# Below this temperature a request is treated as greedy (vLLM uses the same cut-off).
_GREEDY_TEMPERATURE = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(IntEnum):
    """What `RequestOutput`s a streaming caller receives (used from chapter 02 on)."""

    CUMULATIVE = 0  # the whole text so far, every time
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


# --8<-- [start:structured-outputs-params]
@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language: set exactly one field (vLLM's name and fields).

    - `json`: a JSON schema (a dict, or its text); the output is JSON that validates against it.
    - `regex`: the output matches this regular expression, whole.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar in xgrammar's dialect (GBNF-like, starting at `root`).
    - `json_object`: True: the output is any JSON object (OpenAI's `response_format: json_object`).

    The docs page `docs/chapters/11-structured-output.md` explains how a grammar becomes a
    token mask.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(chosen) if chosen else 'none'}"
            )
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "json" and not (isinstance(value, dict) or (isinstance(value, str) and value.strip())):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (dict or non-empty str), got {value!r}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"StructuredOutputsParams.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of non-empty strings, got {value!r}")
            self.choice = list(value)
        if kind == "json_object" and value is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True when set, got {value!r}")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The set field as one canonical string; (kind, spec) is the grammar cache's key."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        if value is True:
            return ""
        # A dict schema or a choice list. Keys keep their order: a schema's property order is
        # the order the grammar generates them in, so reordered schemas are different grammars.
        return json.dumps(value, separators=(",", ":"))
# --8<-- [end:structured-outputs-params]


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: consider the whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, regex, choice or grammar (chapter 11).
    structured_outputs: StructuredOutputsParams | None = None

    # Filled in by the engine, not by the user: every token id that ends the request
    # (eos ids from generation_config.json plus stop_token_ids), unless ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _GREEDY_TEMPERATURE and self.temperature >= 0:
            # Greedy ignores the truncation knobs; reset them so the sampler can skip work.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", self.logprobs, ">= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "StructuredOutputsParams or None")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self) -> SamplingParams:
        """A copy the engine owns, so a caller may reuse or change its own object.

        Every field is an immutable value except the containers, which are copied; a deep
        copy of the whole object cost a server about a tenth of a millisecond per request.
        """
        clone = copy.copy(self)
        clone.stop = list(self.stop)
        clone.stop_token_ids = list(self.stop_token_ids)
        clone.all_stop_token_ids = set(self.all_stop_token_ids)
        if self.structured_outputs is not None:  # holds a JSON schema: nested dicts
            clone.structured_outputs = copy.deepcopy(self.structured_outputs)
        return clone

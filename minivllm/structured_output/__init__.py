"""Structured output: constrain what a request may generate to a JSON schema, regex, choice or grammar.

The pieces, in the order a request meets them (chapter 11, `docs/chapters/11-structured-output.md`):

- `validate_structured_outputs` (here): the front end builds the request's grammar once,
  before the request reaches the engine core, so a bad schema, regex or grammar is a
  `ValueError` naming the problem (the server answers 400) and never a failure in the core.
- `StructuredOutputManager` (`manager.py`): owned by the engine core. It compiles grammars in a
  thread pool, off the step loop, caches them by kind and spec, and each step fills one token
  bitmask for the scheduled structured requests.
- `StructuredOutputRequest` (`request.py`): a request's compiled grammar (a future until it is
  ready) and its matcher, which follows the tokens the request generates.
- `apply_grammar_bitmask` (`bitmask.py`): the model runner's hook, which masks the logits rows
  of structured requests before sampling. It needs only torch.

The grammar engine is xgrammar (`backend_xgrammar.py`), imported only when a request asks for
structured output, so the plain offline engine runs without it (`pip install minivllm[structured]`).
"""

from __future__ import annotations

import re
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams

__all__ = ["validate_structured_outputs"]

# xgrammar's errors start with a timestamp and a C++ source location; the learner needs the rest.
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def validate_structured_outputs(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """Raise ValueError (naming the problem) if `params` cannot become a grammar.

    Builds the grammar (JSON schema → grammar, regex → grammar, EBNF parse): the cheap,
    tokenizer-free half of compiling, which is where every error in the user's spec shows up.
    The engine core compiles against the vocabulary later, off its step loop.
    """
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {type(params).__name__}")
    if tokenizer is None:
        raise ValueError("structured output needs the tokenizer, but the engine has skip_tokenizer_init=True")
    try:
        from minivllm.structured_output.backend_xgrammar import build_grammar
    except ImportError as err:
        raise ValueError(f"structured output needs xgrammar ({err}): pip install 'minivllm[structured]'") from err

    build_grammar(params)


def describe_grammar_error(params: StructuredOutputsParams, err: Exception) -> ValueError:
    """The ValueError for a spec xgrammar refused: which kind, and xgrammar's reason, tidied."""
    reason = _XGRAMMAR_LOCATION.sub("", str(err).strip()).strip() or type(err).__name__
    return ValueError(f"invalid structured output {params.kind}: {reason}")

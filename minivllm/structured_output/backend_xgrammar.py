"""The xgrammar backend of structured output (chapter 11, `docs/chapters/11-structured-output.md`).

xgrammar turns a JSON schema, regex or EBNF grammar into a pushdown automaton over the
*tokenizer's vocabulary*: compiling precomputes, for each automaton state, which tokens can
follow, so that filling the mask of the next step is fast. Three objects matter:

- `TokenizerInfo`: the vocabulary as xgrammar sees it (decoded token strings, the model's
  vocabulary size, the stop tokens). Built once per engine.
- `CompiledGrammar`: one spec compiled against that vocabulary. Shared by every request with
  the same spec (the manager caches it).
- `GrammarMatcher`: one per request; it walks the automaton as tokens are accepted and fills the
  request's row of the token bitmask (bit t of the row set = token t allowed).

This module imports xgrammar at import time; only the structured-output package imports it,
and only when a request asks for structured output.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output import describe_grammar_error


# --8<-- [start:build-grammar]
def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-free grammar of `params`; ValueError if the spec is invalid."""
    try:
        kind = params.kind
        if kind == "json":
            # Compact JSON (no free whitespace between tokens): small models otherwise loop on
            # whitespace, which a schema allows anywhere (vLLM's `disable_any_whitespace`).
            return xgr.Grammar.from_json_schema(params.spec, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # One alternative per choice, each a quoted EBNF literal (JSON escaping fits it).
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as err:
        raise describe_grammar_error(params, err) from err
# --8<-- [end:build-grammar]


class XgrammarBackend:
    """Compiles specs against one model's vocabulary, and makes a matcher per request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        # vocab_size is the model's (the logits' width), which may exceed the tokenizer's: the
        # extra ids are padding, never allowed.
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # The manager keeps the cache (one cache, keyed by kind and spec), so xgrammar's is off.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(build_grammar(params))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab_size / 32)] int32, every bit set (every token allowed)."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


class XgrammarGrammar:
    """One request's position in its grammar: accepts its tokens, fills its bitmask row."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over `token_ids`; False (and stop there) at a token the grammar refuses."""
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is done."""
        return self.matcher.is_terminated()

"""`StructuredOutputRequest`: one request's grammar, as the engine core tracks it (chapter 11).

A request with structured output arrives before its grammar is compiled: compiling runs in the
manager's thread pool, and the request waits in the queue with status WAITING_FOR_FSM (vLLM's
name: the grammar's finite-state machine). The scheduler asks `is_grammar_ready()` each step
and admits the request once it is. From then on `grammar` is the request's own matcher.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from minivllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from minivllm.structured_output.backend_xgrammar import XgrammarGrammar


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        # Set by the manager: the compiled grammar, shared with every request of the same spec.
        self.compiled_grammar: Future[Any] | None = None
        self._grammar: XgrammarGrammar | None = None

    def is_grammar_ready(self) -> bool:
        """True once compiling finished (a compile error counts: `grammar` raises it)."""
        return self.compiled_grammar is not None and self.compiled_grammar.done()

    @property
    def grammar(self) -> XgrammarGrammar:
        """This request's matcher, made on first use from the compiled grammar."""
        if self._grammar is None:
            if not self.is_grammar_ready():
                raise RuntimeError("the grammar is still compiling: the scheduler must not run this request yet")
            from minivllm.structured_output.backend_xgrammar import XgrammarGrammar

            # The front end built this grammar already, so an error here is a bug, raised loudly.
            self._grammar = XgrammarGrammar(self.compiled_grammar.result())
        return self._grammar

"""minivllm: a small, readable re-implementation of the vLLM inference engine.

The public API mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`EngineArgs`. Start reading at chapter 01 (architecture overview).
"""

from minivllm.engine.arg_utils import EngineArgs
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # `LLM` pulls in the model code; import it lazily so `import minivllm` stays cheap.
    if name == "LLM":
        from minivllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs"]

"""The two ways a request can fail once the engine core runs in its own process (chapter 02).

Same names as vLLM's `vllm/v1/engine/exceptions.py`, so code that catches them runs on both.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone. Every request in flight fails; so does every later call.

    Not recoverable: build a new engine. The message says why the core died when it could tell
    (its traceback), or its exit code when it could not (e.g. it was killed).
    """


class EngineGenerateError(RuntimeError):
    """One request failed in the engine core; the engine and the other requests carry on."""

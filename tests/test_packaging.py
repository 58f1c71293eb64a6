"""The package installs what the code needs: every subpackage listed, and no top-level `kernels`."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; CI runs 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "minivllm").rglob("__init__.py")
    }
    missing = sorted(on_disk - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_the_kernels_are_minivllm_kernels_and_nothing_is_named_kernels_at_the_top():
    # A top-level `kernels` folder would shadow the PyPI package `kernels`, which transformers
    # imports (when it is installed) as soon as a model config is read, whenever the checkout's
    # root is on sys.path, as with `python -m pytest` run from it.
    kernels = importlib.import_module("minivllm.kernels")
    assert Path(kernels.__file__).resolve().parent == ROOT / "minivllm" / "kernels"
    assert isinstance(kernels.KERNELS, dict)
    assert not (ROOT / "kernels").exists(), "no top-level kernels/ folder: it would shadow the `kernels` package"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "minivllm" not in str(spec.origin), "`kernels` must not resolve to minivllm's kernels"

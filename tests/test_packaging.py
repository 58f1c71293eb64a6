"""The package installs what the code needs: every subpackage listed, kernels/ as minivllm.kernels."""

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
    assert config["package-dir"]["minivllm.kernels"] == "kernels"


def test_kernels_are_importable_as_minivllm_kernels_only():
    kernels = importlib.import_module("minivllm.kernels")
    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
    assert isinstance(kernels.KERNELS, dict)
    assert importlib.util.find_spec("kernels") is None or "minivllm" not in str(importlib.util.find_spec("kernels").origin), (
        "kernels/ must not be installed as a top-level package named `kernels`"
    )

"""The persistent-kernel experiments of chapter 06, checked on a CPU in Triton's interpreter.

`scripts/gpu/persistent_chain.py` and `scripts/gpu/persistent_decode.py` are measurements,
not engine code, but the chapter's tables rest on their kernels computing the right thing.
On the GPU each script checks every variant against float32 before timing it; here their
`--check` paths run one program (a grid barrier with one program passes at once), so the
arithmetic, the phases and the paged attention are covered by every CI run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU checks run in Triton's interpreter; on a GPU run the scripts")


def _load(name: str):
    sys.path.insert(0, str(SCRIPTS))  # persistent_decode imports persistent_chain's helpers
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_persistent_chain_products_match_float32():
    _load("persistent_chain").check(torch.device("cpu"))  # asserts each product within 1e-2


def test_persistent_decode_layers_match_float32():
    _load("persistent_decode").check(torch.device("cpu"))  # asserts within 1e-3 of the truncating reference


@pytest.mark.parametrize("attention", [1, 2, 3, 4])
def test_persistent_decode_detects_a_wrong_input(attention):
    """The comparison can fail: a q-norm weight and an older token's key, changed after the
    reference was taken, each move the result well past the check's bound. With attention 4
    (4 splits of 13 older tokens) the key at position 5 is in split 0, the one that also holds
    this token, and the key at position 30 in split 2: a merge that dropped a split would miss it."""
    pd = _load("persistent_decode")
    model = pd.DecodeLayers(2, torch.device("cpu"), context=50, hidden=256, heads=4, kv_heads=2, head_dim=64,
                            inter=768)
    tile, splits = (16, 4) if attention == 4 else (32, 8)

    def err() -> float:
        return pd.rel_err(model.run(1, 4, tile, attention, splits), want)

    want = model.reference(truncate=True)
    assert err() < 1e-3
    original = model.w_q_norm[1, 3].item()
    model.w_q_norm[1, 3] = 3.0
    assert err() > 1e-2
    model.w_q_norm[1, 3] = original
    assert err() < 1e-3
    for position in (5, 30):  # an older token's key in layer 0, read by attention from the paged cache
        want = model.reference(truncate=True)  # with the keys changed so far
        assert err() < 1e-3
        model.k0[0, model._slots()[position]] += 1
        model.k_cache.copy_(model.k0)
        assert err() > 1e-3, position

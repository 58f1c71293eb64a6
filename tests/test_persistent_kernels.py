"""The persistent-kernel experiments of chapter 06, checked on a CPU in Triton's interpreter.

`scripts/gpu/persistent_chain.py` and `scripts/gpu/persistent_decode.py` are measurements,
not engine code, but the chapter's tables rest on their kernels computing the right thing.
On the GPU each script checks every variant against float32 before timing it; here their
`--check` paths run one program (a grid barrier with one program passes at once), so the
arithmetic, the phases and the paged attention are covered by every CI run.
`scripts/gpu/persistent_ring.py` is Gluon, which the interpreter does not run: here only its
weight stream's order (against the order its loops read it) and its tagged words are checked.
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


@pytest.mark.parametrize("columns_first", [False, True])
def test_persistent_ring_stream_is_in_the_order_the_kernel_reads_it(columns_first):
    """`persistent_ring.py`'s kernel is Gluon, which the interpreter does not run; on the GPU it
    is checked against float32 before it is timed. What can be checked here is the contract
    between its host-side packing and its loop: walking each program's stream in the kernel's
    order (layers; qkv, o, gate_up, down; row blocks, then column blocks, or for the flow kernel
    column blocks, then row blocks) and multiplying chunk by chunk must give every product's
    rows. A packing that swapped the row and column blocks, or the programs, would give other
    rows, and the comparison fails."""
    pr = _load("persistent_ring")
    chain = pr.Chain(2, torch.device("cpu"), hidden=512, qkv=2048, q=1024, inter=1536)
    programs = 4
    tiles = pr.ring_tiles(chain, programs)
    stream = pr.pack_streams(chain, programs, columns_first)
    rows_of = {"qkv": tiles["R_QKV"], "o": tiles["R_O"], "gate_up": tiles["R_GU"], "down": tiles["R_O"]}
    torch.manual_seed(0)
    for p in range(programs):
        chunk = 0
        for layer in range(chain.layers):
            for name, w in (("qkv", chain.w_qkv), ("o", chain.w_o), ("gate_up", chain.w_gu), ("down", chain.w_down)):
                k = w.shape[2]
                x = torch.randn(k)
                row_blocks, col_blocks = rows_of[name] // pr.CHUNK_ROWS, k // pr.CHUNK_COLS
                got = torch.zeros(row_blocks, pr.CHUNK_ROWS)
                walk = ([(rb, kb) for kb in range(col_blocks) for rb in range(row_blocks)] if columns_first
                        else [(rb, kb) for rb in range(row_blocks) for kb in range(col_blocks)])
                for rb, kb in walk:
                    got[rb] += stream[p, chunk].float() @ x[kb * pr.CHUNK_COLS:(kb + 1) * pr.CHUNK_COLS]
                    chunk += 1
                rows = slice(p * rows_of[name], (p + 1) * rows_of[name])
                want = w[layer, rows].float() @ x
                torch.testing.assert_close(got.flatten(), want, rtol=1e-4, atol=1e-4)  # float32 summation order
        assert chunk == stream.shape[1]  # the kernel's total_chunks: nothing left unread


def test_persistent_ring_tagged_words_round_trip():
    """The tagged kernel's vectors are 32-bit words [tag | bf16 bits]. The host writes x0 as
    tag-0 words and reads the result back; negative values (sign bit set) and any tag must
    come back unchanged, or the GPU check would compare against garbage."""
    pr = _load("persistent_ring")
    chain = pr.Chain(1, torch.device("cpu"), hidden=512, qkv=2048, q=1024, inter=1536)
    vectors = pr.TaggedVectors(chain)
    x0 = torch.tensor([-2.5, -0.0, 0.0, 1.0, 3.0e38, -1.0e-30] * 8, dtype=torch.bfloat16)
    vectors.x = torch.zeros(len(x0), dtype=torch.int32)
    vectors.start(x0)
    assert (pr.TaggedVectors.tags(vectors.x) == 0).all()
    for tag in (0, 1, 112):
        words = vectors.x | (tag << 16)
        assert (pr.TaggedVectors.tags(words) == tag).all()
        assert torch.equal(pr.TaggedVectors.values(words).view(torch.int16), x0.view(torch.int16))

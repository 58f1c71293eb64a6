"""Prefill attention at 2k/4k/8k causal tokens: tile configurations and tile order, beside SDPA's
flash and cuDNN backends in the same run (chapter 06). Run on the GPU machine:

    python scripts/gpu/sweep_prefill.py     # prints a table; writes $OUT/sweep_prefill.json

The tiles are built once outside the timed call (as the backend does once per step), so the
times are the kernel's alone. "lightest first" launches the same tiles in the reverse order.
"""

import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from minivllm.kernels import paged_prefill_attention, paged_prefill_attention_reference, prefill_block_m, prefill_tiles

H, KVH, D, BS = 32, 8, 128, 16
dt = torch.bfloat16


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


results = []
for T in (2048, 4096, 8192):
    blocks = T // BS
    kv = torch.randn(2, blocks, BS, KVH, D, dtype=dt, device="cuda")
    bt = torch.arange(blocks, device="cuda").view(1, -1).int()
    sl = torch.tensor([T], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    q = torch.randn(T, H, D, dtype=dt, device="cuda")
    flops = 2 * T * T * H * D  # causal: half of 4*T*T*H*D
    ref = paged_prefill_attention_reference(q, kv, bt, sl, qsl, D**-0.5) if T == 2048 else None
    qt = q.transpose(0, 1)[None]
    k = kv[0].reshape(T, KVH, D).transpose(0, 1)[None].repeat_interleave(H // KVH, 1)
    v = kv[1].reshape(T, KVH, D).transpose(0, 1)[None].repeat_interleave(H // KVH, 1)
    sdpa = {}
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        with sdpa_kernel(backend):
            sdpa[name] = flops / ms(lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True)) / 1e9
    for rows, bn, w, st, order in itertools.product([64, 128, 256], [64, 128], [4, 8], [2, 3, 4], ["heaviest", "lightest"]):
        if order == "lightest" and not (rows == 128 and bn == 128 and w == 8 and st == 3):
            continue  # the order comparison at the defaults only
        row = {"tokens": T, "rows": rows, "block_n": bn, "warps": w, "stages": st, "order": order}
        try:
            tiles = prefill_tiles([T], [T], prefill_block_m(H, KVH, rows), q.device)
            if order == "lightest":
                tiles = tiles.flip(1).contiguous()
            f = lambda: paged_prefill_attention(q, kv, bt, sl, qsl, D**-0.5, tiles=tiles, block_rows=rows,  # noqa: E731
                                                block_n=bn, num_warps=w, num_stages=st)
            if ref is not None:
                out = f()
                row["err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t = ms(f)
            row.update(ms=t, TFLOPs=flops / t / 1e9, vs_flash=flops / t / 1e9 / sdpa["flash"], vs_cudnn=flops / t / 1e9 / sdpa["cudnn"])
        except Exception as err:  # a configuration that does not compile (shared memory)
            row["error"] = str(err)[:120]
        results.append(row)
    results.append({"tokens": T, "sdpa_flash_TFLOPs": sdpa["flash"], "sdpa_cudnn_TFLOPs": sdpa["cudnn"]})

json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_prefill.json"), "w"), indent=1)
print(f"{'T':>5} {'rows':>4} {'bn':>4} {'w':>2} {'st':>2} {'order':>9} {'TFLOP/s':>8} {'xflash':>6} {'xcudnn':>6}")
for T in (2048, 4096, 8192):
    rows = [r for r in results if r["tokens"] == T and "TFLOPs" in r]
    default = [r for r in rows if (r["rows"], r["block_n"], r["warps"], r["stages"]) == (128, 128, 8, 3)]
    best = sorted(rows, key=lambda r: -r["TFLOPs"])[:3]
    for r in default + best:
        print(f"{T:>5} {r['rows']:>4} {r['block_n']:>4} {r['warps']:>2} {r['stages']:>2} {r['order']:>9} "
              f"{r['TFLOPs']:>8.0f} {r['vs_flash']:>6.2f} {r['vs_cudnn']:>6.2f}")
    s = [r for r in results if r["tokens"] == T and "sdpa_flash_TFLOPs" in r][0]
    print(f"{T:>5} sdpa flash {s['sdpa_flash_TFLOPs']:.0f}, cudnn {s['sdpa_cudnn_TFLOPs']:.0f} TFLOP/s")
errs = [r["err"] for r in results if "err" in r]
print("max relative error vs reference at 2k:", max(errs) if errs else None)

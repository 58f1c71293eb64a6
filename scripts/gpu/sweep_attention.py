"""Sweep the attention kernels' tile/warp/stage/split settings on the GPU; print the best.

    python scripts/gpu/sweep_attention.py   (run on the GPU machine)
"""

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps  # noqa: E402
from minivllm.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_reference, paged_prefill_attention, paged_prefill_attention_reference,
)

ms = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
dt = torch.bfloat16
copy = copy_bandwidth_gbps()
results = {"copy_GBps": copy, "decode": [], "prefill": []}

# decode: batch 64, ctx 4096, 32/8 heads, d128, bs16
B, C, H, KVH, D, BS = 64, 4096, 32, 8, 128, 16
blocks = B * C // BS
kv = torch.randn(2, blocks, BS, KVH, D, dtype=dt, device="cuda")
bt = torch.randperm(blocks, device="cuda").view(B, -1).int()
sl = torch.full((B,), C, dtype=torch.int32, device="cuda")
q = torch.randn(B, H, D, dtype=dt, device="cuda")
nbytes = 2 * B * C * KVH * D * 2
small = slice(0, 4)
ref = paged_decode_attention_reference(q[small], kv, bt[small], sl[small], D**-0.5)
for bn, w, st, splits in itertools.product([32, 64, 128], [4, 8], [2, 3, 4], [1, 2, 4, 8]):
    try:
        f = lambda: paged_decode_attention(q, kv, bt, sl, D**-0.5, max_seq_len=C, num_splits=splits, block_n=bn, num_warps=w, num_stages=st)  # noqa: E731
        out = f()
        err = ((out[small].float() - ref.float()).norm() / ref.float().norm()).item()
        t = ms(f)
        results["decode"].append({"block_n": bn, "warps": w, "stages": st, "splits": splits, "ms": t, "GBps": nbytes / t / 1e6, "err": err})
    except Exception as e:  # a config that does not compile (e.g. out of shared memory)
        results["decode"].append({"block_n": bn, "warps": w, "stages": st, "splits": splits, "error": str(e)[:100]})
ok = [r for r in results["decode"] if "GBps" in r and r["err"] < 2e-2]
best = max(ok, key=lambda r: r["GBps"])
print("decode best", best, f"{best['GBps'] / copy:.2f}x copy")

# prefill: 4096 tokens, 32/8 heads, d128
T = 4096
pb = T // BS
kvp = torch.randn(2, pb, BS, KVH, D, dtype=dt, device="cuda")
btp = torch.arange(pb, device="cuda").view(1, -1).int()
slp = torch.tensor([T], dtype=torch.int32, device="cuda")
qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
qp = torch.randn(T, H, D, dtype=dt, device="cuda")
flops = 2 * T * T * H * D  # causal half of 4*T*T*H*D
ref_p = paged_prefill_attention_reference(qp[:512], kvp, btp, torch.tensor([512], dtype=torch.int32, device="cuda"),
                                          torch.tensor([0, 512], dtype=torch.int32, device="cuda"), D**-0.5)
for rows, bn, w, st in itertools.product([64, 128, 256], [32, 64, 128], [4, 8], [1, 2, 3]):
    try:
        f = lambda: paged_prefill_attention(qp, kvp, btp, slp, qsl, D**-0.5, query_lens_cpu=[T], block_rows=rows, block_n=bn, num_warps=w, num_stages=st)  # noqa: E731
        small_out = paged_prefill_attention(qp[:512], kvp, btp, torch.tensor([512], dtype=torch.int32, device="cuda"),
                                            torch.tensor([0, 512], dtype=torch.int32, device="cuda"), D**-0.5,
                                            query_lens_cpu=[512], block_rows=rows, block_n=bn, num_warps=w, num_stages=st)
        err = ((small_out.float() - ref_p.float()).norm() / ref_p.float().norm()).item()
        t = ms(f)
        results["prefill"].append({"rows": rows, "block_n": bn, "warps": w, "stages": st, "ms": t, "TFLOPs": flops / t / 1e9, "err": err})
    except Exception as e:
        results["prefill"].append({"rows": rows, "block_n": bn, "warps": w, "stages": st, "error": str(e)[:100]})
okp = [r for r in results["prefill"] if "TFLOPs" in r and r["err"] < 2e-2]
bestp = max(okp, key=lambda r: r["TFLOPs"])
print("prefill best", bestp)
kk = torch.randn(1, KVH, T, D, dtype=dt, device="cuda").repeat_interleave(H // KVH, 1)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    tf = ms(lambda: F.scaled_dot_product_attention(qp.transpose(0, 1)[None], kk, kk, is_causal=True))
print(f"sdpa flash {flops / tf / 1e9:.0f} TFLOP/s")
results["sdpa_flash_TFLOPs"] = flops / tf / 1e9
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json"), "w"), indent=1)
print("top decode:", sorted(ok, key=lambda r: -r["GBps"])[:5])
print("top prefill:", sorted(okp, key=lambda r: -r["TFLOPs"])[:5])

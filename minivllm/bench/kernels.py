"""Kernel benchmarks on the GPU: each Triton kernel against the hardware and the best torch
alternative, in one run (chapter 06).

    python -m minivllm.bench.kernels --json out.json

Times are medians of CUDA-event timings after warm-up (`triton.testing.do_bench`). Bandwidth
counts the bytes a kernel must move at least (inputs read once, outputs written once); it is
reported beside the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from minivllm.bench.ceilings import bf16_gemm_tflops, copy_bandwidth_gbps


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def bench_decode(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128, block_size=16):
    from minivllm.kernels import paged_decode_attention

    dt = torch.bfloat16
    blocks = batch * context // block_size
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, dtype=dt, device="cuda")
    bt = torch.randperm(blocks, device="cuda").view(batch, -1).int()
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, dtype=dt, device="cuda")
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    t_kernel = _ms(lambda: paged_decode_attention(q, kv, bt, sl, head_dim**-0.5, max_seq_len=context))
    # SDPA on the same problem with K/V laid out contiguously (no paging): the bar to reach.
    k = torch.randn(batch, kv_heads, context, head_dim, dtype=dt, device="cuda")
    v = torch.randn_like(k)
    t_sdpa = _ms(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    # The torch reference backend's way: gather the pages, then SDPA.
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.attention.torch_backend import TorchAttentionBackend

    meta = AttentionMetadata(batch, torch.zeros(batch, dtype=torch.long, device="cuda"),
                             torch.arange(batch + 1, dtype=torch.int32, device="cuda"), sl, bt, batch, 1, context,
                             list(range(batch + 1)), [context] * batch)
    t_gather = _ms(lambda: TorchAttentionBackend._decode(q, kv, meta, head_dim**-0.5))
    gbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    return {"kernel": "paged_decode_attention", "shape": f"b{batch} ctx{context} h{heads}/{kv_heads} d{head_dim} bs{block_size}",
            "ms": t_kernel, "GBps": gbps(t_kernel), "sdpa_contiguous_ms": t_sdpa, "sdpa_contiguous_GBps": gbps(t_sdpa),
            "torch_gather_sdpa_ms": t_gather, "torch_gather_sdpa_GBps": gbps(t_gather)}


def bench_prefill(tokens=4096, heads=32, kv_heads=8, head_dim=128, block_size=16):
    from minivllm.kernels import paged_prefill_attention

    dt = torch.bfloat16
    blocks = tokens // block_size
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, dtype=dt, device="cuda")
    bt = torch.arange(blocks, device="cuda").view(1, -1).int()
    sl = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, heads, head_dim, dtype=dt, device="cuda")
    flops = 4 * tokens * tokens * heads * head_dim / 2  # causal: half the score matrix
    t_kernel = _ms(lambda: paged_prefill_attention(q, kv, bt, sl, qsl, head_dim**-0.5, query_lens_cpu=[tokens], seq_lens_cpu=[tokens]))
    qt = q.transpose(0, 1)[None]
    k = torch.randn(1, kv_heads, tokens, head_dim, dtype=dt, device="cuda").repeat_interleave(heads // kv_heads, 1)
    v = torch.randn_like(k)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    result = {"kernel": "paged_prefill_attention", "shape": f"t{tokens} h{heads}/{kv_heads} d{head_dim}",
              "ms": t_kernel, "TFLOPs": flops / (t_kernel * 1e-3) / 1e12}
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                ms = _ms(lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True))
            result[f"sdpa_{name}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
        except RuntimeError as err:  # a backend not available for this shape/build
            result[f"sdpa_{name}_TFLOPs"] = f"unavailable: {str(err)[:80]}"
    return result


def bench_elementwise(tokens=16384, hidden=4096):
    from minivllm.kernels import fused_add_rms_norm, rotary_embedding, silu_and_mul
    from minivllm.kernels.activation import silu_and_mul_reference
    from minivllm.kernels.rms_norm import fused_add_rms_norm_reference
    from minivllm.models.layers.rotary import RotaryEmbedding

    dt = torch.bfloat16
    results = []
    x, r = (torch.randn(tokens, hidden, dtype=dt, device="cuda") for _ in range(2))
    w = torch.randn(hidden, dtype=dt, device="cuda")
    compiled_norm = torch.compile(fused_add_rms_norm_reference)
    nbytes = 4 * tokens * hidden * 2  # read x, residual; write out, residual; (weight negligible)
    for name, fn in [("triton", lambda: fused_add_rms_norm(x, r, w, 1e-6)), ("torch.compile", lambda: compiled_norm(x, r, w, 1e-6))]:
        ms = _ms(fn)
        results.append({"kernel": "fused_add_rms_norm", "impl": name, "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9})
    y = torch.randn(tokens, 2 * hidden, dtype=dt, device="cuda")
    compiled_silu = torch.compile(silu_and_mul_reference)
    nbytes = 3 * tokens * hidden * 2
    for name, fn in [("triton", lambda: silu_and_mul(y)), ("torch.compile", lambda: compiled_silu(y))]:
        ms = _ms(fn)
        results.append({"kernel": "silu_and_mul", "impl": name, "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9})
    heads, head_dim = hidden // 128, 128
    q = torch.randn(tokens, heads, head_dim, dtype=dt, device="cuda")
    k = torch.randn(tokens, heads // 4, head_dim, dtype=dt, device="cuda")
    cache = RotaryEmbedding(head_dim, 32768, 1e6).cos_sin_cache.cuda()
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    from minivllm.kernels.rotary import rotary_embedding_reference

    compiled_rope = torch.compile(rotary_embedding_reference)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    for name, fn in [("triton", lambda: rotary_embedding(pos, q, k, cache)), ("torch.compile", lambda: compiled_rope(pos, q, k, cache))]:
        ms = _ms(fn)
        results.append({"kernel": "rotary_embedding", "impl": name, "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9})
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_GBps": copy_bandwidth_gbps(), "bf16_gemm_TFLOPs": bf16_gemm_tflops()}
    result["decode"] = bench_decode()
    result["prefill"] = [bench_prefill(t) for t in (2048, 4096, 8192)]
    result["elementwise"] = bench_elementwise()
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        open(args.json, "w").write(text)
    d = result["decode"]
    print(f"copy {result['copy_GBps']:.0f} GB/s, bf16 GEMM {result['bf16_gemm_TFLOPs']:.0f} TFLOP/s")
    print(f"decode: {d['GBps']:.0f} GB/s ({d['GBps'] / result['copy_GBps']:.2f}x copy), SDPA contiguous "
          f"{d['sdpa_contiguous_GBps']:.0f} GB/s, torch gather+SDPA {d['torch_gather_sdpa_GBps']:.0f} GB/s")
    for p in result["prefill"]:
        print(f"prefill {p['shape']}: {p['TFLOPs']:.0f} TFLOP/s; SDPA flash {p['sdpa_flash_TFLOPs']}, cudnn {p['sdpa_cudnn_TFLOPs']}")
    for e in result["elementwise"]:
        print(f"{e['kernel']:<20} {e['impl']:<14} {e['GBps']:.0f} GB/s")
    return result


if __name__ == "__main__":
    main()

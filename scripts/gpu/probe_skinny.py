# Which skinny GEMM settings give a large error on the GPU (the test drew one at bf16).
import itertools, sys, os, torch
sys.path.insert(0, os.getcwd())
from minivllm.kernels.gemm import skinny_gemm, skinny_gemm_reference
def rel(a, b): return ((a.float()-b.float()).norm()/b.float().norm().clamp_min(1e-30)).item()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
worst = {}
TOKENS = (1, 2, 3) if torch.cuda.is_available() else (1,)
shapes = [(1, 1), (1, 7), (3, 64), (5, 65), (17, 130), (64, 700), (300, 333), (2, 513)]
for tokens, gated, each, bn, dtype, (n, k) in itertools.product(TOKENS, (False, True), (False, True), (2, 4), (torch.bfloat16,), shapes):
    for trial in range(3):
        x = torch.randn(tokens, 2*k if gated else k, generator=g).to(dtype).to(DEV)
        w = torch.randn(n, k, generator=g).to(dtype).to(DEV); b = torch.randn(n, generator=g).to(dtype).to(DEV)
        for bias in (None, b):
            out, ref = skinny_gemm(x, w, bias, gated, block_n=bn, block_k=64, sum_each_slice=each), skinny_gemm_reference(x, w, bias, gated)
            e = rel(out, ref)
            # the error against the size of the terms summed: |input| @ |w|.T (+ |bias|)
            a = (skinny_gemm_reference(x, w, None, gated).float() * 0 + (torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float() if gated else x.float()).abs() @ w.float().abs().T)
            if bias is not None: a = a + bias.float().abs()
            c = ((out.float() - ref.float()).abs() / a).max().item()
            key = (tokens, gated, each, bn)
            if e > worst.get(key, (0,))[0]: worst[key] = (e, n, k, bias is not None, c)
            worst_c = worst.setdefault(("c",) + key, 0.0); worst[("c",) + key] = max(worst_c, c)
for key, v in sorted((k, v) for k, v in worst.items() if k[0] != "c"):
    print("tokens gated sum_each bn", key, "worst rel err %.4f n=%d k=%d bias=%s (its term-relative %.2e)" % v, "worst term-relative %.2e" % worst[("c",) + key])

"""`minivllm bench ...` in this process, with one engine variant patched in (chapters 05, 06).

    python scripts/gpu/engine_variants.py VARIANT -- bench throughput --shape llama-3.2-1b ...

VARIANT is `default` (the code as it is), `cublas` (the skinny GEMM never picked: every
linear layer through cuBLAS), `nofreeze` (the start-up heap left to the garbage collector),
`decode=BLOCK_N,WARPS,STAGES` (that decode-kernel configuration for head_dim 64), or
`decode-all=BLOCK_N,WARPS,STAGES` (that configuration for every head size), or
`heads-fastest=0|1` (the decode kernel's launch order: sequences or KV heads fastest), or
`torch-sampler` (every batch sampled by the PyTorch path, never the one-pass kernel),
`nopdl` (no programmatic dependent launch), `merge-kernel` (the decode splits merged by a
second kernel), `unfused-kv` (K/V written by their own kernel, not by RoPE's), `before-pdl`
(all three: the kernels as they were before PDL and the two fusions), `skinny-all` (the
skinny GEMM for every product of at most 4 tokens, cuBLAS never), `skinny-few=T` (the skinny
GEMM for every product of at most T tokens, gate_up included, the default rule for more),
`norm-in-product=T` (the add + RMSNorm before qkv and gate_up done inside the skinny GEMM for
every product of at most T tokens, whatever its K; 0: never), `norm-weight-at-use` (that norm's
weight loaded in each slice where it is used, not one slice ahead: fewer registers),
`skinny-tile=BN,BK,W,S`
(that tile for every skinny product), `min-split=T` (the decode kernel's shortest split, in
tiles), `whole-context=T` (the longest context it keeps in one split, in tiles), `late-loads` (the decode kernel
loads nothing before its PDL wait), `no-rope` (timing only, its outputs are wrong: where the
RoPE kernel would also write the cache, neither runs: the most a RoPE fused into another
kernel could save), `no-attention` (timing only: the decode attention kernel does not run, o takes
the query as it is), `no-norm` (timing only: every RMSNorm returns its input, residual sums
skipped), `shared-weights` (timing only: every decoder layer computes with layer 0's weights,
which then stay in the 50 MB L2 of an H100 or H200 for a Qwen3-0.6B layer; the LM head still
reads its own, and its 311 MB passing through L2 sends the first layer of each step back to
DRAM once), or several joined by "+" (applied in order). The first three timing-only ones
bound what fusing each operator away could save in the whole step; `shared-weights`, what the
layers take when no weight comes from DRAM, a ceiling for anything done on the memory side. It lets one GPU run compare
defaults in the whole engine, where a kernel sweep alone can mislead.
"""

import os
import sys

# After PYTHONPATH, not before it: an earlier tree given there (executor.sh's OLD_TREE) is the one imported.
sys.path.append(os.getcwd())

variant, bench_args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]


def apply(part: str) -> None:
    """Patch one variant into the modules the engine is about to import."""
    if part == "cublas":
        import minivllm.kernels.gemm as skinny

        skinny.skinny_gemm_wins = lambda num_tokens, n, k: False
    elif part == "nofreeze":
        import importlib

        importlib.import_module("minivllm.engine.core").freeze_gc_heap = lambda: None
    elif part.startswith("decode="):
        import minivllm.kernels as kernels
        import minivllm.kernels.paged_attention as paged

        block_n, warps, stages = (int(v) for v in part.removeprefix("decode=").split(","))
        default_config = paged.decode_config
        paged.decode_config = kernels.decode_config = (
            lambda head_dim: (block_n, warps, stages) if head_dim <= 64 else default_config(head_dim))
    elif part.startswith("decode-all="):  # that decode-kernel configuration for every head size
        import minivllm.kernels as kernels
        import minivllm.kernels.paged_attention as paged

        config = tuple(int(v) for v in part.removeprefix("decode-all=").split(","))
        paged.decode_config = kernels.decode_config = lambda head_dim: config
    elif part.startswith("heads-fastest="):
        import minivllm.kernels.paged_attention as paged

        paged.DECODE_HEADS_FASTEST = part.removeprefix("heads-fastest=") == "1"
    elif part == "torch-sampler":
        import minivllm.sample.sampler as sampler

        sampler.one_pass_sampling_applies = lambda logits, metadata: False
    elif part in ("nopdl", "merge-kernel", "unfused-kv", "before-pdl"):
        if part in ("nopdl", "before-pdl"):
            os.environ["MINIVLLM_PDL"] = "0"
        if part in ("merge-kernel", "before-pdl"):
            import minivllm.kernels.paged_attention as paged

            paged.DECODE_MERGE_IN_KERNEL = False
        if part in ("unfused-kv", "before-pdl"):
            from minivllm.models.layers.attention import Attention

            Attention.fused_kv_write = lambda self, q: None
    elif part == "skinny-all":  # the skinny GEMM for every product of at most 4 tokens
        import minivllm.kernels.gemm as skinny

        skinny.skinny_gemm_wins = lambda num_tokens, n, k: num_tokens <= 4
    elif part.startswith("skinny-few="):  # the skinny GEMM for every product of at most T tokens, the default rule above
        import minivllm.kernels.gemm as skinny

        few, default_wins = int(part.removeprefix("skinny-few=")), skinny.skinny_gemm_wins
        skinny.skinny_gemm_wins = lambda num_tokens, n, k: num_tokens <= few or default_wins(num_tokens, n, k)
    elif part.startswith("skinny-tile="):  # that tile for every skinny product
        import minivllm.kernels.gemm as skinny

        bn, bk, warps, stages = (int(v) for v in part.removeprefix("skinny-tile=").split(","))
        skinny.skinny_tile = lambda num_tokens, tile=(bn, bk, warps, stages, False): tile
    elif part.startswith("min-split="):  # the decode kernel's shortest split, in tiles
        import minivllm.kernels.paged_attention as paged

        paged.DECODE_MIN_SPLIT_TILES = int(part.removeprefix("min-split="))
    elif part.startswith("whole-context="):  # the longest context the decode kernel keeps in one split, in tiles
        import minivllm.kernels.paged_attention as paged

        paged.DECODE_WHOLE_CONTEXT_TILES = int(part.removeprefix("whole-context="))
    elif part == "no-rope":  # timing only, wrong outputs: no RoPE kernel, K/V never written (its cost at most)
        from minivllm.models.layers.rotary import RotaryEmbedding

        rope_forward = RotaryEmbedding.forward
        RotaryEmbedding.forward = lambda self, positions, query, key, q_norm=None, k_norm=None, kv_write=None: (
            (query, key) if kv_write is not None else rope_forward(self, positions, query, key, q_norm, k_norm, kv_write))
    elif part == "no-attention":  # timing only, wrong outputs: no decode attention kernel where RoPE wrote the cache
        from minivllm.models.layers.attention import Attention

        attention_forward = Attention.forward
        Attention.forward = lambda self, q, k, v, kv_written=False: (
            q.reshape(q.shape[0], -1) if kv_written else attention_forward(self, q, k, v, kv_written))
    elif part == "no-norm":  # timing only, wrong outputs: no RMSNorm kernel (and no residual sum)
        from minivllm.models.layers.norm import RMSNorm

        RMSNorm.forward = lambda self, x, residual=None: x if residual is None else (x, residual)
        import minivllm.models.llama as llama  # the norms that go with the product after them

        llama.rms_norm_linear = lambda norm, proj, x, residual: (proj(x), x if residual is None else residual)
    elif part.startswith("norm-in-product="):  # the pre-norm inside the product for at most T tokens (0: never)
        import minivllm.kernels.gemm as gemm

        gemm.NORM_IN_PRODUCT_MAX_TOKENS = int(part.removeprefix("norm-in-product="))
        gemm.NORM_IN_PRODUCT_MAX_K = 1 << 62  # whatever the product's K (the rule adopted keeps one slice)
    elif part == "norm-weight-at-use":  # the norm inside the product loads its weight where it is used
        import minivllm.kernels.gemm as gemm

        gemm.NORM_WEIGHT_LOADED_AHEAD = False
    elif part == "shared-weights":  # timing only: every decoder layer reads layer 0's weights, which stay in L2
        import minivllm.executor.model_runner as runner

        load_model = runner.ModelRunner.load_model

        def load_model_shared(self) -> None:
            load_model(self)
            layers = self.model.model.layers
            first = dict(layers[0].named_parameters())
            for layer in layers[1:]:
                for name, param in layer.named_parameters():
                    param.data = first[name].data  # the other layers' own weights are freed
            if self.device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

        runner.ModelRunner.load_model = load_model_shared
    elif part == "late-loads":  # the decode kernel waits for the previous kernel before any load
        import minivllm.kernels.paged_attention as paged

        paged.DECODE_EARLY_LOADS = False
    elif part != "default":
        raise SystemExit(f"unknown variant {part!r}")


for part in variant.split("+"):
    apply(part)

from minivllm.cli.main import main  # noqa: E402

sys.exit(main(bench_args))

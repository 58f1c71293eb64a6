"""`minivllm bench ...` in this process, with one engine variant patched in (chapters 05, 06).

    python scripts/gpu/engine_variants.py VARIANT -- bench throughput --shape llama-3.2-1b ...

VARIANT is `default` (the code as it is), `cublas` (the skinny GEMM never picked: every
linear layer through cuBLAS), `nofreeze` (the start-up heap left to the garbage collector),
`decode=BLOCK_N,WARPS,STAGES` (that decode-kernel configuration for head_dim 64), or
`heads-fastest=0|1` (the decode kernel's launch order: sequences or KV heads fastest), or
`torch-sampler` (every batch sampled by the PyTorch path, never the one-pass kernel). It lets one GPU run compare defaults in the whole engine,
where a kernel sweep alone can mislead.
"""

import os
import sys

sys.path.insert(0, os.getcwd())

variant, bench_args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
if variant == "cublas":
    import minivllm.kernels.gemm as skinny

    skinny.skinny_gemm_wins = lambda num_tokens, n, k: False
elif variant == "nofreeze":
    import importlib

    importlib.import_module("minivllm.engine.core").freeze_gc_heap = lambda: None
elif variant.startswith("decode="):
    import minivllm.kernels as kernels
    import minivllm.kernels.paged_attention as paged

    block_n, warps, stages = (int(v) for v in variant.removeprefix("decode=").split(","))
    default_config = paged.decode_config
    paged.decode_config = kernels.decode_config = (
        lambda head_dim: (block_n, warps, stages) if head_dim <= 64 else default_config(head_dim))
elif variant.startswith("heads-fastest="):
    import minivllm.kernels.paged_attention as paged

    paged.DECODE_HEADS_FASTEST = variant.removeprefix("heads-fastest=") == "1"
elif variant == "torch-sampler":
    import minivllm.sample.sampler as sampler

    sampler.one_pass_sampling_applies = lambda logits, metadata: False
elif variant != "default":
    raise SystemExit(f"unknown variant {variant!r}")

from minivllm.cli.main import main  # noqa: E402

sys.exit(main(bench_args))

"""CUDA graphs and torch.compile change how the forward pass is launched, never what it computes.

Greedy tokens from eager PyTorch, from decode steps replayed as full CUDA graphs (padded to
the captured sizes), from prefill and mixed steps replayed as piecewise graphs (attention
eager between the pieces), and from the torch.compile'd model must be identical, on tiny
random models in float32 (peaked enough that rounding cannot flip a greedy choice) with a
batch that exercises padding (5 requests run the size-8 graph) and mixed prefill/decode
steps. Needs CUDA: run on the GPU machine (scripts/gpu/executor.sh).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from hf_reference import make_tiny_model
from minivllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LENGTHS = [5, 33, 70, 12, 100]
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_model(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(3)
    return folder, [[rng.randrange(2, 380) for _ in range(n)] for n in PROMPT_LENGTHS]


def run(folder, prompts, max_tokens: int = MAX_TOKENS, **engine_args) -> tuple[list[list[int]], dict]:
    """Greedy tokens of one engine, and what its model runner did; the engine is freed after."""
    # A fixed, small cache: engines of earlier tests may still hold theirs (the memory profile
    # of a second engine in one process would count the first one's cache as its own peak).
    llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, **engine_args)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    graphs, pieces = runner.cuda_graphs, runner.piecewise_graphs
    replays: list[int] = []
    piecewise_replays: list[int] = []
    if graphs is not None:  # count the replays: a test that never replays proves nothing
        replay = graphs.replay
        graphs.replay = lambda size: replays.append(size) or replay(size)
    if pieces is not None:
        replay_pieces = pieces.replay
        pieces.replay = lambda size, meta: piecewise_replays.append(size) or replay_pieces(size, meta)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    info = {"graph_sizes": sorted(graphs.graphs) if graphs is not None else None, "replays": replays,
            "piecewise_sizes": sorted(pieces.pieces) if pieces is not None else None,
            "piecewise_replays": piecewise_replays,
            "overlapped_steps": llm.llm_engine.engine_core.num_overlapped_steps}
    llm.llm_engine.engine_core.shutdown()
    del llm, graphs, pieces, runner  # drop every reference to the engine: the next one sizes its cache from what is free
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, info


def first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cuda_graphs_give_the_eager_tokens(tiny_model):
    folder, prompts = tiny_model
    eager, info = run(folder, prompts, enforce_eager=True)
    assert info["graph_sizes"] is None and info["piecewise_sizes"] is None, "enforce_eager must capture nothing"
    graphs, info = run(folder, prompts, cuda_graph_sizes="1,2,4,8", cudagraph_mode="full_decode_only")
    assert info["graph_sizes"] == [1, 2, 4, 8] and info["piecewise_sizes"] is None
    assert info["replays"] and set(info["replays"]) <= {8, 4, 2, 1}, "decode steps must replay graphs"
    assert 8 in info["replays"], "5 decoding requests run padded to the size-8 graph"
    for i, (a, b) in enumerate(zip(eager, graphs)):
        assert a == b, f"prompt {i}: CUDA graphs diverged from eager at token {first_difference(a, b)}"


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_piecewise_graphs_give_the_eager_tokens(tiny_model, mode):
    """Prompts of 5..100 tokens in one 220-token step run padded to the 256 pieces; with a
    32-token budget, chunks and decodes share steps (attention over a mixed batch, eager)."""
    folder, prompts = tiny_model
    for budget, sizes, padded in [(8192, "8,16,256", 256), (32, "8,16,32", 32)]:
        eager, _ = run(folder, prompts, enforce_eager=True, max_num_batched_tokens=budget)
        graphs, info = run(folder, prompts, cudagraph_mode=mode, cuda_graph_sizes="1,2,4,8",
                           piecewise_cuda_graph_sizes=sizes, max_num_batched_tokens=budget)
        assert info["piecewise_sizes"] == [int(n) for n in sizes.split(",")]
        assert padded in info["piecewise_replays"], f"the first step must run padded to the size-{padded} pieces"
        if mode == "piecewise":
            assert info["graph_sizes"] is None and 8 in info["piecewise_replays"], "5 decodes run the 8-token pieces"
        else:
            assert 8 in info["replays"] and 8 not in info["piecewise_replays"], "decode-only steps run full graphs"
        for i, (a, b) in enumerate(zip(eager, graphs)):
            assert a == b, f"budget {budget}, prompt {i}: {mode} diverged from eager at token {first_difference(a, b)}"


def test_an_unowned_view_aliases_memory_without_keeping_it():
    from minivllm.executor.cuda_graphs import unowned_view

    base = torch.arange(24, dtype=torch.bfloat16, device="cuda").view(4, 6)
    view = unowned_view(base[:, 1:5])  # strided, offset
    assert view.dtype == torch.bfloat16 and view.shape == (4, 4) and view.stride() == (6, 1)
    assert view.data_ptr() == base[:, 1:5].data_ptr() and torch.equal(view, base[:, 1:5])
    base[2, 3] = -1
    assert view[2, 2] == -1, "the view must alias the memory, not copy it"
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    view = unowned_view(big)
    before = torch.cuda.memory_allocated()
    del big
    assert torch.cuda.memory_allocated() == before - (64 << 20), "the view must not keep the memory allocated"


def test_async_scheduling_gives_the_eager_tokens(tiny_model):
    """Step n+1's decodes read step n's tokens on the device, also inside a replayed graph."""
    eager, _ = run(tiny_model[0], tiny_model[1], enforce_eager=True)
    overlapped, info = run(tiny_model[0], tiny_model[1], cuda_graph_sizes="1,2,4,8", async_scheduling=True,
                           piecewise_cuda_graph_sizes="16,256")
    assert info["replays"] and info["piecewise_replays"], "decode steps must replay graphs, the prefill pieces"
    assert info["overlapped_steps"] > 0, "no step was launched while another ran"
    for i, (a, b) in enumerate(zip(eager, overlapped)):
        assert a == b, f"prompt {i}: async scheduling diverged from eager at token {first_difference(a, b)}"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-compile"))
    rng = random.Random(4)
    return folder, [[rng.randrange(2, 380) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_torch_compile_gives_the_eager_tokens_with_and_without_graphs(tiny_qwen3):
    # One architecture: compiling takes tens of seconds, and the compiled code is the same
    # Llama decoder for every model of the family.
    folder, prompts = tiny_qwen3
    eager, _ = run(folder, prompts, enforce_eager=True)
    compiled, _ = run(folder, prompts, enforce_eager=True, compilation_level=1)
    both, info = run(folder, prompts, compilation_level=1, cuda_graph_sizes="8", piecewise_cuda_graph_sizes="256")
    assert info["replays"] and info["piecewise_replays"] == [256], "decodes replay full graphs, the prefill pieces"
    for name, tokens in [("torch.compile", compiled), ("torch.compile + CUDA graphs", both)]:
        for i, (a, b) in enumerate(zip(eager, tokens)):
            assert a == b, f"prompt {i}: {name} diverged from eager at token {first_difference(a, b)}"


def _forget_compiled_kernels() -> None:
    """Empty the in-memory caches of minivllm's Triton kernels (the disk cache stays)."""
    from minivllm.kernels import jit_functions

    for fn in jit_functions():
        fn.device_caches.clear()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_no_kernel_compiles_after_the_warm_up(tiny_qwen3, enforce_eager):
    # A compile in a running engine stalls every request of the step for a second or more:
    # the engine compiles every variant its steps can need at start-up. Steps here vary the
    # batch size, split prompts into chunks, hit the prefix cache (prefills with context) and
    # decode next to prefills.
    from minivllm.kernels import num_compiled_variants

    folder, _ = tiny_qwen3
    _forget_compiled_kernels()
    llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=256, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    after_start = num_compiled_variants()
    assert after_start > 0, "the warm-up compiled nothing: the count cannot be trusted"
    rng = random.Random(5)
    shared = [rng.randrange(2, 380) for _ in range(48)]
    for num_prompts in (1, 3, 7, 2):
        prompts = [shared + [rng.randrange(2, 380) for _ in range(rng.randint(1, 150))] for _ in range(num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0, "the workload must hit the prefix cache"
    assert num_compiled_variants() == after_start, "a kernel was compiled after the warm-up"
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_the_multiprocess_executor_gives_the_same_tokens_on_cuda(tiny_qwen3):
    # The worker in its own process owns the GPU, the graphs and the cache; the tokens that
    # come back through the broadcast queue must be the in-process worker's.
    folder, prompts = tiny_qwen3
    uni, _ = run(folder, prompts, cuda_graph_sizes="1,2,4,8")
    llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, cuda_graph_sizes="1,2,4,8", distributed_executor_backend="mp")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    mp = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.llm_engine.engine_core.shutdown()
    assert mp == uni

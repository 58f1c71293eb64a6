"""The executor, worker and model runner (chapter 05), on the CPU.

* The multi-process executor (a worker process, SchedulerOutputs broadcast over a pipe) gives
  the same tokens as the in-process one, through chunked prefill and preemption.
* A worker process that dies surfaces as `EngineDeadError`, not a hang.
* The KV-cache sizing refuses to start when one max-length request cannot fit.
* The persistent batch gives the same tokens whether a request keeps its row or is moved.
* Decode batches padded to a captured size (what CUDA graphs replay) give the same tokens;
  the padding arithmetic runs here through the Triton interpreter, the graphs on the GPU
  (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal

import pytest
import torch

from conftest import TEST_DEVICE
from hf_reference import make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.exceptions import EngineDeadError

PROMPT_LENGTHS = [3, 17, 20, 9, 14]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 400) for _ in range(n)] for n in PROMPT_LENGTHS]
    return folder, prompts


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


# Small budgets force chunked prefill (16 tokens a step) and preemption (too few blocks).
STRESS = dict(max_num_batched_tokens=16, num_gpu_blocks_override=9, block_size=4, max_model_len=32)


def test_the_engine_freezes_its_start_up_heap(tiny_qwen3):
    """Objects alive when the engine starts go to the collector's permanent generation, so
    that the step loop's collections do not walk them (`freeze_gc_heap`, chapter 05)."""
    import gc

    folder, _ = tiny_qwen3
    marker: list = []
    marker.append(marker)  # a reference cycle: an object the collector tracks
    assert any(o is marker for o in gc.get_objects())
    LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", max_model_len=64)
    assert not any(o is marker for o in gc.get_objects()), "the start-up heap was not frozen"
    created_after: list = []
    created_after.append(created_after)
    assert any(o is created_after for o in gc.get_objects()), "objects made after start-up must stay collectable"


@pytest.mark.slow
def test_multiprocess_executor_matches_the_in_process_one(tiny_qwen3):
    folder, prompts = tiny_qwen3
    common = dict(skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", **STRESS)
    uni = LLM(str(folder), distributed_executor_backend="uni", **common)
    expected = greedy_tokens(uni, prompts)
    assert uni.llm_engine.engine_core.scheduler.num_preemptions > 0, "the stress settings should preempt"
    mp = LLM(str(folder), distributed_executor_backend="mp", **common)
    try:
        executor = mp.llm_engine.engine_core.executor
        assert executor.worker_pids[0] != os.getpid(), "the mp worker must run in a process of its own"
        assert greedy_tokens(mp, prompts) == expected, "one worker process must compute what the in-process worker does"
    finally:
        mp.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_a_killed_worker_process_is_an_engine_error_not_a_hang(tiny_qwen3):
    folder, prompts = tiny_qwen3
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32",
              distributed_executor_backend="mp", num_gpu_blocks_override=64)
    executor = llm.llm_engine.engine_core.executor
    os.kill(executor.worker_pids[0], signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(greedy_tokens, llm, prompts)
        with pytest.raises(EngineDeadError, match="rank 0.*died"):
            future.result(timeout=60)  # a hang fails here instead of stalling the suite
    with pytest.raises(EngineDeadError):
        executor.collective_rpc("get_pid")  # and the executor stays dead


def test_executor_backend_is_checked(tiny_qwen3):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(str(folder), device="cpu", distributed_executor_backend="ray").create_engine_config()


def test_cuda_graph_sizes_parse_from_the_command_line(tiny_qwen3):
    folder, _ = tiny_qwen3
    config = EngineArgs(str(folder), device="cpu", cuda_graph_sizes="8,1,4,4").create_engine_config()
    assert config.compilation_config.cuda_graph_sizes == [1, 4, 8], "sizes are deduplicated and sorted"
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(str(folder), device="cpu", cuda_graph_sizes="1,x").create_engine_config()
    with pytest.raises(ValueError, match="compilation level"):
        EngineArgs(str(folder), device="cpu", compilation_level=3).create_engine_config()



def test_cudagraph_mode_and_piecewise_sizes_are_checked(tiny_qwen3):
    folder, _ = tiny_qwen3
    config = EngineArgs(str(folder), device="cpu", piecewise_cuda_graph_sizes="64,16").create_engine_config()
    cc = config.compilation_config
    assert cc.piecewise_cuda_graph_sizes == [16, 64] and cc.cudagraph_mode == "full_and_piecewise"
    assert cc.full_decode_graphs and cc.piecewise_graphs
    eager = EngineArgs(str(folder), device="cpu", enforce_eager=True).create_engine_config().compilation_config
    assert not eager.full_decode_graphs and not eager.piecewise_graphs, "enforce_eager captures nothing"
    decode_only = EngineArgs(str(folder), device="cpu", cudagraph_mode="full_decode_only").create_engine_config()
    assert decode_only.compilation_config.full_decode_graphs and not decode_only.compilation_config.piecewise_graphs
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        EngineArgs(str(folder), device="cpu", cudagraph_mode="full").create_engine_config()
    with pytest.raises(ValueError, match="piecewise_cuda_graph_sizes"):
        EngineArgs(str(folder), device="cpu", piecewise_cuda_graph_sizes="0,16").create_engine_config()


def test_the_piecewise_ladder_pads_by_less_than_a_quarter_above_256():
    from minivllm.executor.cuda_graphs import padded_batch_size, piecewise_capture_sizes

    sizes = piecewise_capture_sizes(8192)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert [n for n in sizes if 256 < n <= 1024] == [320, 384, 448, 512, 640, 768, 896, 1024]
    for num_tokens in range(1, 8193):
        size = padded_batch_size(num_tokens, sizes)
        assert size is not None and size >= num_tokens
        if num_tokens > 256:
            assert size - num_tokens < num_tokens / 4, f"{num_tokens} tokens pad to {size}"
    assert piecewise_capture_sizes(100)[-1] == 100, "the step budget is always a size"
    assert piecewise_capture_sizes(3000)[-2:] == [2560, 3000]
    assert piecewise_capture_sizes(64, requested=[8, 512, 32]) == [8, 32], "sizes past the budget are never used"


# -- memory sizing ------------------------------------------------------------------------------


def test_one_max_length_request_that_does_not_fit_is_refused_with_the_numbers(tiny_qwen3):
    from minivllm.executor.worker import Worker

    folder, _ = tiny_qwen3
    worker = Worker.__new__(Worker)  # only the report: no model needed
    worker.config = EngineArgs(str(folder), device="cpu", max_model_len=512, block_size=16).create_engine_config()
    gib = 2**30
    # 32 blocks are needed for 512 tokens; 31 fit.
    with pytest.raises(ValueError, match=r"not even one request of max_model_len=512 fits.*needs 32 blocks") as err:
        worker._report(total=80 * gib, others=0, weights=gib, peak=2 * gib, num_blocks=31, bytes_per_block=1 << 20)
    assert "gpu_memory_utilization" in str(err.value), "the message says which setting to change"
    worker._report(total=80 * gib, others=0, weights=gib, peak=2 * gib, num_blocks=64, bytes_per_block=1 << 20)
    assert worker.memory_profile["max_concurrency"] == 2.0, "64 blocks hold two requests of 32 blocks"
    assert worker.memory_profile["activation_peak_GiB"] == 1.0, "the activation peak is the peak minus the weights"


def test_reused_sampling_metadata_samples_what_rebuilt_metadata_samples(tiny_qwen3, monkeypatch):
    """Decode steps that sample the same requests reuse the last step's sampling tensors; the
    tokens must be those of rebuilding them every step, with penalties (which read each
    request's growing output) and min_tokens (whose blocked stop tokens change) in the batch."""
    import collections

    from minivllm.executor import model_runner

    folder, prompts = tiny_qwen3
    requests = [{"prompt_token_ids": p} for p in prompts]
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=128)
    plain = greedy_tokens(LLM(str(folder), **engine), prompts, max_tokens=12)
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False,
                               frequency_penalty=1.5, repetition_penalty=1.3)
    # Stop tokens the model wants to emit late: blocked for the first 6 outputs, then allowed.
    params = [penalized if i % 2 else SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=6, detokenize=False,
        stop_token_ids=[collections.Counter(plain[i][6:]).most_common(1)[0][0]]) for i in range(len(prompts))]
    builds: list[int] = []
    real_build = model_runner.build_sampling_metadata
    monkeypatch.setattr(model_runner, "build_sampling_metadata", lambda *a: builds.append(1) or real_build(*a))

    def run() -> tuple[list[list[int]], list[str], list[list[int]]]:
        llm = LLM(str(folder), **engine)
        outputs = llm.generate(requests, params, use_tqdm=False)
        only_penalized = llm.generate(requests, penalized, use_tqdm=False)  # reused from the second step on
        return ([list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].finish_reason for o in outputs],
                [list(o.outputs[0].token_ids) for o in only_penalized])

    reused = run()
    num_builds_reused = len(builds)
    real_method = model_runner.ModelRunner._sampling_metadata

    def rebuild_every_step(self, req_ids):
        self.last_sampling_metadata = None
        return real_method(self, req_ids)

    monkeypatch.setattr(model_runner.ModelRunner, "_sampling_metadata", rebuild_every_step)
    builds.clear()
    rebuilt = run()
    assert num_builds_reused < len(builds), "premise: some steps reused the last step's metadata"
    assert "stop" in rebuilt[1][::2], "premise: a min_tokens request stopped on its stop token once allowed"
    assert reused == rebuilt


# -- persistent batch and padding ---------------------------------------------------------------


def test_rows_are_reused_and_a_resumed_request_gets_a_fresh_block_table():
    import numpy as np

    from minivllm.executor.gpu_input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=8, pin_memory=False)
    a = CachedRequestState("a", [5, 6, 7], [], SamplingParams(), None)
    batch.add_request(a, [3, 4], num_computed_tokens=0)
    batch.add_request(CachedRequestState("b", [1], [], SamplingParams(), None), [9], num_computed_tokens=0)
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request(CachedRequestState("c", [1], [], SamplingParams(), None), [1], 0)
    batch.append_tokens(["b", "a"], [4, 8])
    row = batch.req_id_to_row["a"]
    assert batch.token_ids_np[row, :4].tolist() == [5, 6, 7, 8] and a.output_token_ids == [8]
    assert batch.token_ids_np[batch.req_id_to_row["b"], :2].tolist() == [1, 4] and batch.num_tokens[row] == 4
    batch.remove_request("b")
    batch.add_request(CachedRequestState("c", [2, 2], [], SamplingParams(), None), [1], 0)
    assert len(batch) == 2, "a finished request's row goes to the next request"
    batch.append_block_ids("a", [11], replace=True)
    assert batch.num_blocks[row] == 1 and batch.block_table_np[row, 0] == 11, "a resumed request's table is rebuilt"
    assert np.array_equal(batch.rows_of(["c", "a"]), [batch.req_id_to_row["c"], row])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton on the CPU: its interpreter is on only without a GPU")
def test_padded_decode_batches_give_the_same_tokens(tiny_qwen3):
    """Replay decode steps padded to a captured size (eagerly, as the CPU has no graphs)."""
    from minivllm.executor import cuda_graphs
    from minivllm.forward_context import set_forward_context

    folder, prompts = tiny_qwen3
    common = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", attention_backend="triton",
                  num_gpu_blocks_override=64, max_model_len=128)
    expected = greedy_tokens(LLM(str(folder), **common), prompts, max_tokens=6)

    class EagerPaddedRunner(cuda_graphs.CudaGraphRunner):
        """Runs the padded batch over the same buffers and metadata a graph would record."""

        replays: list[int] = []

        def capture(self) -> None:
            self.metadata = {size: self.make_decode_metadata(size) for size in self.capture_sizes}

        def replay(self, size: int):
            self.replays.append(size)
            with set_forward_context(self.metadata[size]):
                return self.forward(self.input_ids[:size], self.positions[:size])

    llm = LLM(str(folder), **common)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.cuda_graphs = EagerPaddedRunner(runner.forward, [2, 8], runner._graph_metadata, runner.input_ids,
                                           runner.positions)
    runner.cuda_graphs.capture()
    assert greedy_tokens(llm, prompts, max_tokens=6) == expected, "padding rows must not change any request's tokens"
    assert 8 in EagerPaddedRunner.replays, "5 decodes should have run padded to 8"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton on the CPU: its interpreter is on only without a GPU")
def test_padded_piecewise_steps_give_the_same_tokens(tiny_qwen3):
    """Steps padded to a piecewise size: K/V written through the padded slot buffer (-1 rows
    skipped), attention told of the real tokens only, its output in the fixed buffer.

    The CPU has no graphs: the stand-in runs the pieces eagerly and, at each attention call,
    does what a replay does there — the piece's cache write over the slot buffer, then the
    layer's attention with K/V None into the fixed output buffer that the next piece reads.
    """
    from minivllm.executor import cuda_graphs
    from minivllm.forward_context import set_forward_context
    from minivllm.models.layers.attention import Attention

    folder, prompts = tiny_qwen3
    common = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", attention_backend="triton",
                  num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=48)
    expected = greedy_tokens(LLM(str(folder), **common), prompts, max_tokens=6)

    class EagerSplit:
        def __init__(self, meta, slot_mapping: torch.Tensor, attn_output: torch.Tensor) -> None:
            self.meta, self.slot_mapping, self.attn_output = meta, slot_mapping, attn_output

        def split_at(self, layer, q, k, v):
            num_tokens = q.shape[0]
            layer.write_kv(k, v, self.slot_mapping[:num_tokens])  # inside the piece on the GPU
            out = self.attn_output[:num_tokens]
            layer.attend(q, None, None, self.meta, output=out.view(q.shape))
            return out

    class EagerPaddedPieces(cuda_graphs.PiecewiseCudaGraphRunner):
        replays: list[tuple[int, int]] = []

        def capture(self) -> None:
            pass

        def replay(self, size: int, meta):
            self.replays.append((size, meta.num_actual_tokens))
            assert (self.slot_mapping[meta.num_actual_tokens : size] == -1).all(), "padded tokens must write nothing"
            with set_forward_context(meta, EagerSplit(meta, self.slot_mapping, self.attn_output)):
                return self.forward(self.input_ids[:size], self.positions[:size])

    llm = LLM(str(folder), **common)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    attn_output = torch.full((64, layer.num_heads * layer.head_dim), float("nan"))  # rows never written stay NaN
    runner.piecewise_graphs = EagerPaddedPieces(runner.forward, [16, 64], runner.input_ids, runner.positions,
                                                runner.slot_mapping, attn_output, None)
    assert greedy_tokens(llm, prompts, max_tokens=6) == expected, "padding tokens must not change any request's tokens"
    assert (64, 48) in EagerPaddedPieces.replays, "48-token chunked steps should have run padded to 64"
    assert (16, 5) in EagerPaddedPieces.replays, "5 decodes should have run padded to 16"


@pytest.mark.slow
def test_torch_compile_gives_the_eager_tokens(tiny_qwen3):
    """Compilation level 1 on the CPU (Inductor's C++ backend); the GPU test adds CUDA graphs."""
    import torch._dynamo

    folder, prompts = tiny_qwen3
    common = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=64)
    expected = greedy_tokens(LLM(str(folder), **common), prompts)
    torch._dynamo.utils.counters.clear()
    compiled = LLM(str(folder), compilation_level=1, **common)
    assert greedy_tokens(compiled, prompts) == expected, "torch.compile must not change greedy tokens"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "the model should really have been compiled"

"""`ModelRunner`: turns a `SchedulerOutput` into one forward pass and sampled tokens.

It keeps every running request in a persistent batch (`InputBatch`: one row of preallocated
host tensors per request) and applies only the scheduler's diffs to it each step. Preparing a
step lays the scheduled tokens of all requests end to end, decode requests first: `input_ids`
and `positions` for the model, and for attention the `slot_mapping` (where each new token's
K/V go), the block tables and the query/sequence lengths. They are written end to end into
one pinned host buffer, copied without blocking in one copy, and unpacked by one kernel into
device buffers that never move (`step_inputs.py`) — which is also what lets a step replay
CUDA graphs captured over those same buffers (`cuda_graphs.py`: whole graphs for decode-only
steps, pieces between attention calls for the others).
Only the rows that finish a prompt or decode are turned into logits and sampled.
Chapter 05 (executor & worker) explains it; chapter 04 draws the slot mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import get_attention_backend
from minivllm.config import EngineConfig
from minivllm.executor.cuda_graphs import (
    CudaGraphRunner,
    PiecewiseCudaGraphRunner,
    cuda_graph_capture_sizes,
    piecewise_capture_sizes,
)
from minivllm.executor.gpu_input_batch import CachedRequestState, InputBatch, flatten_batch
from minivllm.executor.step_inputs import (
    BLOCK_TABLES,
    HEADER_WORDS,
    INPUT_IDS,
    INT32_MAX,
    LOGITS_INDICES,
    POSITIONS,
    QUERY_START_LOC,
    SEQ_LENS,
    SLOT_MAPPING,
    StepInputStager,
)
from minivllm.forward_context import set_forward_context
from minivllm.models.layers.attention import Attention
from minivllm.models.loader import get_model
from minivllm.sample.metadata import SamplingMetadata, build_sampling_metadata
from minivllm.sample.sampler import Sampler
from minivllm.scheduler.output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from minivllm.structured_output.bitmask import apply_grammar_bitmask

logger = logging.getLogger("minivllm")


# --8<-- [start:slot-mapping]
# exercise[ch04-slot-mapping]: slot of position p = block_table[p // block_size] * block_size + p % block_size
def compute_slot_mapping(block_table: list[int], positions: Sequence[int], block_size: int) -> list[int]:
    """The cache slot of each position of one request, given the request's block table.

    The paged cache is a row of `num_blocks * block_size` slots; block b holds slots
    `b * block_size` to `b * block_size + block_size - 1`. `block_table[i]` is the block that
    holds the request's tokens `i * block_size` to `i * block_size + block_size - 1`.
    """
    slots = []
    for pos in positions:
        block_id = block_table[pos // block_size]
        slots.append(block_id * block_size + pos % block_size)
    return slots
# --8<-- [end:slot-mapping]


# --8<-- [start:inputs-from-last-step]
# exercise[ch05-inputs-from-last-step]: the decodes whose position is not among the row's known tokens; their source row is last_sampled_rows[request id]
def inputs_from_last_step(
    decode_positions: np.ndarray, num_known_tokens: np.ndarray, decode_req_ids: list[str], last_sampled_rows: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Async scheduling: the decodes whose input token the previous step is still sampling.

    A step's decodes come first, one token each: decode i computes position
    `decode_positions[i]` of request `decode_req_ids[i]`, whose row in the persistent batch
    holds `num_known_tokens[i]` tokens. A position the row does not hold (`>=` that count) is
    the token the last step sampled for the request, which only the device has: row
    `last_sampled_rows[request id]` of that step's sampled tokens. Return two int64 arrays of
    the same length, in decode order: `dst`, the indices i of those decodes, and `src`,
    their rows in the last step's sampled tokens. Every other decode's input is on the host.
    """
    dst = np.flatnonzero(decode_positions >= num_known_tokens)
    src = np.fromiter((last_sampled_rows[decode_req_ids[i]] for i in dst), dtype=np.int64, count=len(dst))
    return dst.astype(np.int64), src
# --8<-- [end:inputs-from-last-step]


@dataclass
class StepInputs:
    """One prepared step: the order of its requests, and where its inputs sit on the device."""

    req_ids: list[str]
    num_tokens: int
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # indices into req_ids of the requests sampled this step
    # [len(sample_rows)]: the token whose hidden state is sampled; None for the first
    # len(sample_rows) rows in order (a step of decodes), which need no gather
    logits_indices: torch.Tensor | None
    graph_size: int | None  # a captured decode size to replay, or None
    piecewise_size: int | None  # else a token count whose pieces to replay, or None to run eagerly


@dataclass
class SampledOnDevice:
    """The last launched step's sampled tokens, before the host has them (async scheduling)."""

    step_id: int
    token_ids: torch.Tensor  # [number of sampled requests], on the device
    index: dict[str, int]  # request id -> its row of token_ids


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        sched = config.scheduler_config
        self.max_model_len = config.model_config.max_model_len
        self.max_num_reqs = sched.max_num_seqs
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.requests: dict[str, CachedRequestState] = {}  # every unfinished request, with or without a row
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, max_blocks_per_req, device.type == "cuda")
        max_tokens = max(sched.max_num_batched_tokens, self.max_num_reqs)
        # The step's inputs on the device, in buffers that never move (the CUDA graphs read
        # them); each step writes them through one copy of `staging` (step_inputs.py).
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(self.max_num_reqs, dtype=torch.long, device=device)
        # The same buffers in the order of the staged arrays (step_inputs.py), for `upload`.
        self.step_input_buffers = (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                                   self.seq_lens, self.block_tables, self.logits_indices)
        self.staging = StepInputStager(
            HEADER_WORDS + 3 * max_tokens + 3 * self.max_num_reqs + 1 + self.max_num_reqs * max_blocks_per_req, device
        )
        self.sampled_host = [torch.zeros(self.max_num_reqs, dtype=torch.long, pin_memory=device.type == "cuda") for _ in range(2)]
        self.last_sampled: SampledOnDevice | None = None
        self.last_sampling_metadata: tuple[list[str], SamplingMetadata] | None = None
        self.num_steps_launched = 0
        self.sampler = Sampler()
        self.attn_backend = get_attention_backend(config.attention_backend, device)
        self.model: torch.nn.Module | None = None
        self.forward = None  # the model's forward, or its torch.compile'd version
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CudaGraphRunner | None = None
        self.piecewise_graphs: PiecewiseCudaGraphRunner | None = None
        # Recorded after each step's host-to-device copies; a step with no token to sample
        # never syncs, so the next one waits on this before reusing the pinned buffers.
        self.inputs_copied: torch.cuda.Event | None = None

    # --8<-- [start:load-model]
    def load_model(self) -> None:
        self.model = get_model(self.config.model_config, self.device)
        self.forward = self.model
        if self.config.compilation_config.level >= 1:
            # Attention reads the step's layout from the forward context (a global): keep it
            # out of the compiled graphs, which would otherwise specialize on one step's
            # metadata. Everything between two attention calls is compiled and fused.
            for layer in self.model.modules():
                if isinstance(layer, Attention):
                    layer.forward = torch.compiler.disable(layer.forward)
            self.forward = torch.compile(self.model, dynamic=True)
    # --8<-- [end:load-model]

    # -- KV cache ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        mc = self.config.model_config
        element_size = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * element_size

    # --8<-- [start:profile-peak]
    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Run the largest step the scheduler may form once, with no cache; return peak bytes.

        `max_num_batched_tokens` tokens through the model, then the logits and a softmax of
        `max_num_seqs` rows, as a sampling step does. The peak includes the weights.
        """
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        with set_forward_context(None):
            hidden = self.forward(input_ids, positions)
        num_seqs = min(self.max_num_reqs, num_tokens)
        self.model.compute_logits(hidden[:num_seqs]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)
    # --8<-- [end:profile-peak]

    # --8<-- [start:init-kv-cache]
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer, bound to it."""
        mc = self.config.model_config
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if num_blocks * self.block_size > INT32_MAX:  # slots travel as int32 (step_inputs.py)
            raise ValueError(f"{num_blocks} KV blocks of {self.block_size} slots exceed the int32 slot ids")
        shape = (2, num_blocks, self.block_size, layers[0].num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=mc.dtype, device=self.device) for _ in layers]
        for layer, kv_cache in zip(layers, self.kv_caches):
            layer.kv_cache = kv_cache
            layer.impl = self.attn_backend
    # --8<-- [end:init-kv-cache]

    # --8<-- [start:warm-up]
    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile the Triton kernels' variants now, not in the middle of the first requests.

        Triton compiles a kernel the first time it sees a new combination of constexprs and
        argument properties; that takes a second or more, and in a running engine it would
        stall every request in the step. One mixed step (a decode, and a prefill continuing
        cached tokens) runs every kernel of the forward pass, and one separate cache write
        the one piecewise graphs use; then the decode kernel is compiled for each split-tile
        size its in-kernel merge can use; decode steps of 1, 2 and 4 requests compile the
        skinny GEMM's variants (with the RMSNorm or the SiLU-and-mul inside, and the first
        layer's norm, which has no residual to add); then the one-pass sampler (with and
        without noise) for the model's logits, and the kernel that unpacks a step's inputs.
        Nothing is written into the cache: every slot is -1.
        """
        if self.device.type != "cuda" or self.config.attention_backend != "triton" or not self.kv_caches:
            return
        meta = self._warm_up_step([1, 16], [17, 32])
        # That step wrote K/V from the RoPE kernel; piecewise graphs use the separate cache write.
        layer = next(m for m in self.model.modules() if isinstance(m, Attention))
        kv = torch.zeros(meta.num_actual_tokens, layer.num_kv_heads, layer.head_dim, dtype=layer.kv_cache.dtype,
                         device=self.device)
        layer.write_kv(kv, kv, meta.slot_mapping)
        self._warm_up_decode_merge()
        for num_decodes in (1, 2, 4):  # 3 tokens use 4's variants (a power-of-two row tile)
            self._warm_up_step([1] * num_decodes, [17] * num_decodes)
        from minivllm.kernels import argmax_sample, gumbel_sample

        hidden_size = self.config.model_config.hf_config.hidden_size
        logits = self.model.compute_logits(torch.zeros(1, hidden_size, dtype=self.config.model_config.dtype, device=self.device))
        for num_splits in (1, 2):  # a whole row per program, and split rows with their merge
            gumbel_sample(logits, torch.ones(1, device=self.device), 0, num_splits=num_splits)
            argmax_sample(logits, num_splits=num_splits)
        # The step-input kernel: compiled for this engine's buffers by a first copy.
        self.staging.start()
        self.staging.take(INPUT_IDS, 1)[:] = 0
        self.staging.upload(self.step_input_buffers, None)
        torch.cuda.synchronize(self.device)

    def _warm_up_step(self, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        """One forward pass over requests with these query and context lengths, decodes
        (one-token queries) first; every slot is -1, so the cache is not written."""
        num_tokens = sum(query_lens)
        int32 = dict(dtype=torch.int32, device=self.device)
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor(query_start_loc, **int32),
            seq_lens=torch.tensor(seq_lens, **int32),
            block_tables=torch.zeros(len(seq_lens), self.block_tables.shape[1], **int32),
            num_decodes=sum(1 for query_len in query_lens if query_len == 1),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
        )
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(self.device)
        with set_forward_context(meta):
            self.forward(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions)
        return meta

    def _warm_up_decode_merge(self) -> None:
        from minivllm import kernels

        layer = next(m for m in self.model.modules() if isinstance(m, Attention))
        query = torch.zeros(1, layer.num_heads, layer.head_dim, dtype=layer.kv_cache.dtype, device=self.device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=self.device)
        block_tables = torch.zeros(1, self.block_tables.shape[1], dtype=torch.int32, device=self.device)
        block_n, _, _ = kernels.decode_config(layer.head_dim)  # the launcher's default tile
        # The most splits a step can use: one sequence of max_model_len tokens.
        most_splits = kernels.decode_num_splits(1, layer.num_kv_heads, self.max_model_len, self.device, block_n)
        # One split (the partial kernel writes the output itself), then each merge tile size.
        split_counts, block_s = [1], 16
        while block_s <= kernels.merge_block_s(most_splits):
            split_counts.append(min(block_s, most_splits))
            block_s *= 2
        for splits in dict.fromkeys(split_counts):
            kernels.paged_decode_attention(query, layer.kv_cache, block_tables, seq_lens, layer.scale,
                                           max_seq_len=splits * block_n, num_splits=splits, block_n=block_n)
    # --8<-- [end:warm-up]

    # --8<-- [start:capture-cuda-graphs]
    def capture_cuda_graphs(self) -> None:
        """Capture the graphs `cudagraph_mode` asks for, if this device and backend use them."""
        cc = self.config.compilation_config
        if self.device.type != "cuda" or not (cc.full_decode_graphs or cc.piecewise_graphs):
            return
        if self.config.attention_backend != "triton":
            # The torch reference backend writes padded rows' K/V to slot -1 (the cache's last
            # slot) and sizes its gather from host values: it is for reading, not for graphs.
            logger.info("CUDA graphs need the triton attention backend; running eagerly")
            return
        pool = torch.cuda.graph_pool_handle()  # one pool: no two graphs ever run at once
        if cc.piecewise_graphs:
            sizes = piecewise_capture_sizes(self.input_ids.shape[0], cc.piecewise_cuda_graph_sizes)
            if sizes:
                layer = next(m for m in self.model.modules() if isinstance(m, Attention))
                attn_output = torch.zeros(
                    sizes[-1], layer.num_heads * layer.head_dim, dtype=self.config.model_config.dtype, device=self.device
                )
                self.piecewise_graphs = PiecewiseCudaGraphRunner(
                    self.forward, sizes, self.input_ids, self.positions, self.slot_mapping, attn_output, pool
                )
                self.piecewise_graphs.capture()
        if cc.full_decode_graphs:
            sizes = cuda_graph_capture_sizes(self.max_num_reqs, cc.cuda_graph_sizes)
            self.cuda_graphs = CudaGraphRunner(
                self.forward, sizes, self._graph_metadata, self.input_ids, self.positions, pool
            )
            self.cuda_graphs.capture()
    # --8<-- [end:capture-cuda-graphs]

    def _graph_metadata(self, size: int) -> AttentionMetadata:
        """Decode metadata over the device buffers for a captured batch of `size` requests."""
        self.slot_mapping[:size].fill_(-1)  # capture writes nothing into the cache
        self.seq_lens[:size].fill_(1)
        self.query_start_loc[: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        return AttentionMetadata(
            num_actual_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            max_query_len=1,
            # A host-side bound every replay must respect: no sequence is longer than this.
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
        )

    # -- one step ---------------------------------------------------------------------------

    # --8<-- [start:execute-model]
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step on the device and return before it finishes.

        Everything up to sampling is queued on the device; the sampled tokens start on their
        way to pinned host memory, and the returned output waits for them only when asked
        (`get_output`). The next step may be prepared meanwhile: its decodes take their
        input tokens from this step's `sampled` tensor on the device (`_prepare_inputs`).
        """
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return AsyncModelRunnerOutput(lambda: ModelRunnerOutput([], []))
        step = self._prepare_inputs(scheduler_output)
        if step.graph_size is not None:
            hidden_states = self.cuda_graphs.replay(step.graph_size)
        elif step.piecewise_size is not None:
            hidden_states = self.piecewise_graphs.replay(step.piecewise_size, step.attn_metadata)
        else:
            with set_forward_context(step.attn_metadata):
                hidden_states = self.forward(self.input_ids[: step.num_tokens], self.positions[: step.num_tokens])
        if not step.sample_rows:
            return AsyncModelRunnerOutput(lambda: ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids]))
        # In the model's dtype: the sampler upcasts where it computes (the one-pass kernel in
        # its registers, saving a float32 copy of [B, V]).
        if step.logits_indices is None:
            sampled_hidden = hidden_states[: len(step.sample_rows)]
        else:
            sampled_hidden = hidden_states[step.logits_indices]
        logits = self.model.compute_logits(sampled_hidden)
        sampled_req_ids = [step.req_ids[i] for i in step.sample_rows]
        sampling_metadata = self._sampling_metadata(sampled_req_ids)
        # Structured output (chapter 11): tokens a request's grammar forbids get logit -inf.
        logits = apply_grammar_bitmask(logits, sampled_req_ids, scheduler_output)
        sampler_output = self.sampler(logits, sampling_metadata)
        sampled = sampler_output.sampled_token_ids
        self.num_steps_launched += 1
        step_id = self.num_steps_launched
        self.last_sampled = SampledOnDevice(step_id, sampled, {step.req_ids[i]: j for j, i in enumerate(step.sample_rows)})
        host_tokens, copied = sampled, None
        if self.device.type == "cuda":  # two pinned buffers: step n+1 copies while n is read
            host_tokens = self.sampled_host[step_id % 2][: len(sampled)]
            host_tokens.copy_(sampled, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return AsyncModelRunnerOutput(lambda: self._finish_step(step, step_id, host_tokens, copied, sampler_output))

    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        """The sampling tensors of the requests sampled this step, in this order.

        Most decode steps sample the same requests as the step before, one token further: then
        the last step's tensors are reused, as vLLM refreshes its sampling metadata only when
        the persistent batch changed. Only min_tokens depends on a request's progress (its
        stop tokens are blocked until it has enough outputs); while it blocks any, rebuild.
        Penalties read the requests' live output lists, so reused metadata sees new tokens.
        """
        last = self.last_sampling_metadata
        if last is not None and last[0] == req_ids and not last[1].min_tokens_blocked:
            return last[1]
        states = [self.input_batch.requests[r] for r in req_ids]
        metadata = build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.device,
        )
        self.last_sampling_metadata = (req_ids, metadata)
        return metadata

    def _finish_step(self, step: StepInputs, step_id: int, host_tokens: torch.Tensor,
                     copied: torch.cuda.Event | None, sampler_output) -> ModelRunnerOutput:
        """Wait for a launched step's tokens; record them in the persistent batch."""
        if copied is not None:
            copied.synchronize()
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        output = ModelRunnerOutput(step.req_ids, sampled_ids)
        token_ids = host_tokens.tolist()
        kept_ids, kept_tokens = [], []
        for i, token_id in zip(step.sample_rows, token_ids):
            req_id = step.req_ids[i]
            # With async scheduling the next step was prepared meanwhile and may have dropped
            # the request (finished, aborted, preempted): its row is gone, nothing to record.
            if req_id in self.input_batch:
                kept_ids.append(req_id)
                kept_tokens.append(token_id)
            sampled_ids[i] = [token_id]
        self.input_batch.append_tokens(kept_ids, kept_tokens)
        if self.last_sampled is not None and self.last_sampled.step_id == step_id:
            self.last_sampled = None  # the host holds these tokens now
        if sampler_output.logprobs is not None:
            _scatter_logprobs(output, step.sample_rows, sampler_output)
        return output
    # --8<-- [end:execute-model]

    # --8<-- [start:update-states]
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the persistent batch: drop, add, extend."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            # A preempted request waits without a row (its row may go to a new request); its
            # tokens stay in self.requests until it is resumed with a fresh block table.
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), [], params, generator)
            self.requests[new.req_id] = state
            batch.add_request(state, new.block_ids, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            if cached.req_id not in batch:  # resumed after preemption
                batch.add_request(self.requests[cached.req_id], cached.new_block_ids, cached.num_computed_tokens)
                continue
            if cached.new_block_ids or cached.resumed_from_preemption:  # most decode steps add no block
                batch.append_block_ids(cached.req_id, cached.new_block_ids, replace=cached.resumed_from_preemption)
            batch.num_computed_tokens[batch.req_id_to_row[cached.req_id]] = cached.num_computed_tokens
    # --8<-- [end:update-states]

    # --8<-- [start:prepare-inputs]
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()  # the last step's copy has read the pinned buffer
        batch = self.input_batch
        # Decodes (one token) first: the attention backends handle them as one group.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        rows = batch.rows_of(req_ids)
        num_reqs = len(req_ids)
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_tokens = int(num_scheduled.sum())
        num_computed = batch.num_computed_tokens[rows]
        seq_lens = num_computed + num_scheduled
        num_decodes = int((num_scheduled == 1).sum())
        graph_size = piecewise_size = None
        if self.cuda_graphs is not None and num_decodes == num_reqs:
            graph_size = self.cuda_graphs.padded_size(num_reqs)
        if graph_size is None and self.piecewise_graphs is not None:
            piecewise_size = self.piecewise_graphs.padded_size(num_tokens)
        # A full graph runs graph_size one-token requests: the padded ones write nothing (slot
        # -1) and attend to a one-token context in block 0. The pieces run piecewise_size
        # tokens (the padding is token 0 at position 0, slot -1), of which attention is told
        # only of the real ones (num_actual_tokens below); the padded rows are dropped.
        padded_reqs = graph_size or num_reqs
        padded_tokens = graph_size or piecewise_size or num_tokens

        stage = self.staging
        stage.start()
        # As many block-table columns as the longest context needs: no kernel reads further.
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        block_table = stage.take_rows(BLOCK_TABLES, padded_reqs, width)
        np.take(batch.block_table_np[:, :width], rows, axis=0, out=block_table[:num_reqs])
        block_table[num_reqs:] = 0
        req_indices, positions, slot_mapping = flatten_batch(num_computed, num_scheduled, block_table[:num_reqs],
                                                             self.block_size)
        input_ids = stage.take(INPUT_IDS, padded_tokens)
        input_ids[:num_tokens] = batch.token_ids_np[rows[req_indices], positions]
        input_ids[num_tokens:] = 0
        staged_positions = stage.take(POSITIONS, padded_tokens)
        staged_positions[:num_tokens] = positions
        staged_positions[num_tokens:] = 0
        staged_slots = stage.take(SLOT_MAPPING, padded_tokens)
        staged_slots[:num_tokens] = slot_mapping
        staged_slots[num_tokens:] = -1
        query_start_loc = stage.take(QUERY_START_LOC, padded_reqs + 1)
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1 : num_reqs + 1])
        query_start_loc[num_reqs + 1 :] = np.arange(num_tokens + 1, num_tokens + 1 + padded_reqs - num_reqs)
        staged_seq_lens = stage.take(SEQ_LENS, padded_reqs)
        staged_seq_lens[:num_reqs] = seq_lens
        staged_seq_lens[num_reqs:] = 1
        batch.num_computed_tokens[rows] = seq_lens
        # Caught up with every known token: sample the next one.
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        logits_indices = query_start_loc[sample_rows + 1] - 1
        # In a step of decodes every row is sampled in order: the first rows, no gather.
        gather_logits = not np.array_equal(logits_indices, np.arange(len(sample_rows)))
        if gather_logits:
            stage.take(LOGITS_INDICES, len(logits_indices))[:] = logits_indices
        last_sampled = None
        if self.last_sampled is not None:
            # Async scheduling: decodes whose input token the previous step is still sampling
            # (decodes come first, one token each: request i's input is token i). Token id
            # -(r + 1) tells the unpacking kernel to take row r of that step's tokens, on the
            # device, after the previous step's sampler in stream order.
            pending, pending_src = inputs_from_last_step(
                positions[:num_decodes], batch.num_tokens[rows[:num_decodes]], req_ids[:num_decodes],
                self.last_sampled.index,
            )
            if len(pending):
                input_ids[pending] = -(pending_src + 1)
                last_sampled = self.last_sampled.token_ids
        query_start_loc_cpu = query_start_loc[: num_reqs + 1].tolist()
        seq_lens_cpu = seq_lens.tolist()
        stage.upload(self.step_input_buffers, last_sampled)
        if self.device.type == "cuda":
            self.inputs_copied = torch.cuda.Event()
            self.inputs_copied.record()
        n = graph_size or num_tokens  # the rows attention computes
        meta = AttentionMetadata(
            num_actual_tokens=n,
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: padded_reqs + 1],
            seq_lens=self.seq_lens[:padded_reqs],
            block_tables=self.block_tables[:padded_reqs],
            num_decodes=num_decodes,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        logits_rows = self.logits_indices[: len(logits_indices)] if gather_logits else None
        return StepInputs(req_ids, num_tokens, meta, sample_rows.tolist(), logits_rows, graph_size, piecewise_size)
    # --8<-- [end:prepare-inputs]


def _scatter_logprobs(output: ModelRunnerOutput, sample_rows: list[int], sampler_output) -> None:
    """Scatter the sampled rows' logprobs back to one row per scheduled request."""
    num_reqs = len(output.req_ids)
    n_cols = sampler_output.logprobs.shape[1]
    rows = torch.tensor(sample_rows)
    output.logprob_token_ids = torch.zeros(num_reqs, n_cols, dtype=torch.long)
    output.logprobs = torch.zeros(num_reqs, n_cols)
    output.sampled_token_ranks = torch.zeros(num_reqs, dtype=torch.long)
    output.logprob_token_ids[rows] = sampler_output.logprob_token_ids.cpu()
    output.logprobs[rows] = sampler_output.logprobs.cpu()
    output.sampled_token_ranks[rows] = sampler_output.sampled_token_ranks.cpu()

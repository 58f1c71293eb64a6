"""`ModelRunner`: turns a `SchedulerOutput` into one forward pass and sampled tokens.

It keeps its own record of every running request (tokens, block table, generator), updated
from the scheduler's diffs. Each step it flattens the scheduled tokens of all requests into one
batch, decode requests first: `input_ids` and `positions` for the model, and for attention the
`slot_mapping` (where each new token's K/V go), the block tables and the query/sequence
lengths. Only the rows that finish a prompt or decode are turned into logits and sampled.
Chapter 05 (executor & worker) explains it; chapter 04 draws the slot mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import get_attention_backend
from minivllm.config import EngineConfig
from minivllm.forward_context import set_forward_context
from minivllm.models.layers.attention import Attention
from minivllm.models.loader import get_model
from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.sampler import Sampler
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler.output import ModelRunnerOutput, SchedulerOutput

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


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        # Slice each part on its own: concatenating them would copy the whole sequence on
        # every decode step of every request.
        num_prompt = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:end] if start < num_prompt else []
        tail = self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
        return head + tail


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.attn_backend = get_attention_backend(config.attention_backend, device)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self) -> None:
        self.model = get_model(self.config.model_config, self.device)

    # -- KV cache ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        mc = self.config.model_config
        element_size = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * element_size

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Run the largest batch a step may hold once, with no cache; return peak bytes (CUDA)."""
        num_tokens = min(self.config.scheduler_config.max_num_batched_tokens, self.config.model_config.max_model_len)
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None):
            hidden = self.model(input_ids, positions)
        num_seqs = min(self.config.scheduler_config.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_seqs]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    # --8<-- [start:init-kv-cache]
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer, bound to it."""
        mc = self.config.model_config
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        shape = (2, num_blocks, self.block_size, layers[0].num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=mc.dtype, device=self.device) for _ in layers]
        for layer, kv_cache in zip(layers, self.kv_caches):
            layer.kv_cache = kv_cache
            layer.impl = self.attn_backend
    # --8<-- [end:init-kv-cache]

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        req_ids, input_ids, positions, meta, sample_rows = self._prepare_inputs(scheduler_output)
        with set_forward_context(meta):
            hidden_states = self.model(input_ids, positions)
        # Only the last token of a request that completes its prompt (or decodes) is sampled.
        logits_indices = [meta.query_start_loc_cpu[i + 1] - 1 for i in sample_rows]
        sampled_ids = [[] for _ in req_ids]
        output = ModelRunnerOutput(req_ids, sampled_ids)
        if not sample_rows:
            return output
        logits = self.model.compute_logits(hidden_states[logits_indices]).float()
        states = [self.requests[req_ids[i]] for i in sample_rows]
        sampling_metadata = build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.device,
        )
        sampler_output = self.sampler(logits, sampling_metadata)
        for row, (i, token_id) in enumerate(zip(sample_rows, sampler_output.sampled_token_ids.tolist())):
            states[row].output_token_ids.append(token_id)
            sampled_ids[i] = [token_id]
        if sampler_output.logprobs is not None:
            # Scatter the sampled rows' logprobs back to one row per scheduled request.
            n_cols = sampler_output.logprobs.shape[1]
            rows = torch.tensor(sample_rows)
            output.logprob_token_ids = torch.zeros(len(req_ids), n_cols, dtype=torch.long)
            output.logprobs = torch.zeros(len(req_ids), n_cols)
            output.sampled_token_ranks = torch.zeros(len(req_ids), dtype=torch.long)
            output.logprob_token_ids[rows] = sampler_output.logprob_token_ids.cpu()
            output.logprobs[rows] = sampler_output.logprobs.cpu()
            output.sampled_token_ranks[rows] = sampler_output.sampled_token_ranks.cpu()
        return output

    # --8<-- [start:update-states]
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, [], params, generator, list(new.block_ids), new.num_computed_tokens
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)  # a fresh block table
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
    # --8<-- [end:update-states]

    # --8<-- [start:prepare-inputs]
    def _prepare_inputs(self, so: SchedulerOutput):
        # Decodes (one token) first: the attention backends handle them as one group.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + so.num_scheduled_tokens[req_id]
            input_ids += state.token_ids(start, end)
            positions += range(start, end)
            slot_mapping += compute_slot_mapping(state.block_ids, range(start, end), self.block_size)
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            if end >= state.num_tokens:  # caught up with every known token: sample the next
                sample_rows.append(i)
            state.num_computed_tokens = end
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_tables = [self.requests[r].block_ids + [0] * (max_blocks - len(self.requests[r].block_ids)) for r in req_ids]
        to_device = lambda data, dtype: torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            slot_mapping=to_device(slot_mapping, torch.long),
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            num_decodes=sum(1 for r in req_ids if so.num_scheduled_tokens[r] == 1),
            max_query_len=max(so.num_scheduled_tokens.values()),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return req_ids, to_device(input_ids, torch.long), to_device(positions, torch.long), meta, sample_rows
    # --8<-- [end:prepare-inputs]

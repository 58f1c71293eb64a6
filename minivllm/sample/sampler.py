"""The sampler: from one step's logits [B, V] to one new token per row.

Chapter 06 (models & operators) teaches each transformation below; chapter 03 shows where the
batch comes from. The order is vLLM v1's:

1. logprobs, if any row wants them, from the *raw* logits (before penalties and temperature:
   they describe what the model predicted, not what the sampler did with it);
2. logits processors that can change the argmax: min_tokens masking, then the repetition,
   frequency and presence penalties;
3. greedy rows take the argmax now. Random rows go on: temperature, then min-p, then top-k and
   top-p, then softmax, then one draw from the resulting distribution;
4. the logprobs of the sampled token and of the top-N tokens, with the sampled token's rank.

Each transformation is a small function over the whole batch (row-specific values arrive as
[B] tensors and broadcast over V), so one step costs a few vectorized operations whatever
the number of requests. Masked tokens get logit -inf, so softmax gives them probability 0.

On a GPU, a batch that asks for temperature and nothing else skips steps 2 and 3's PyTorch
operations: one Triton kernel (`minivllm/kernels/sampling.py`, the Gumbel-max trick) scales,
adds noise and takes the argmax in a single read of the logits (`one_pass_sampling_applies`);
an all-greedy batch takes the same kernel without the noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sampling_params import _GREEDY_TEMPERATURE  # below it a row is greedy: one cut-off everywhere


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Column 0: the sampled token; columns 1..N: the top-N tokens by raw logprob, where
    # N = max_num_logprobs of the batch. Rows that asked for fewer are sliced by the caller.
    logprob_token_ids: torch.Tensor | None  # [B, N + 1] int64
    logprobs: torch.Tensor | None  # [B, N + 1] float32
    sampled_token_ranks: torch.Tensor | None  # [B] int64; 1 = the most likely token


class Sampler(torch.nn.Module):
    # --8<-- [start:sampler-forward]
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)

        if one_pass_sampling_applies(logits, metadata):
            # Temperature and the draw in one read of the logits (kernels/sampling.py). Imported
            # here: importing the kernels defines them, which only a GPU run may do at any time.
            from minivllm.kernels import call_kernel

            if metadata.all_greedy:  # the same kernel with its noise off: the argmax
                sampled = call_kernel("argmax_sample", logits)
            else:
                sampled = call_kernel("gumbel_sample", logits, metadata.temperature, draw_seed())
        else:
            # Every function below returns a new tensor, so the caller's logits stay untouched.
            logits = logits.to(torch.float32)
            logits = apply_min_tokens(logits, metadata.min_tokens_blocked)
            if not metadata.no_penalties:
                logits = apply_penalties(
                    logits,
                    metadata.prompt_token_ids,
                    metadata.output_token_ids,
                    metadata.repetition_penalties,
                    metadata.presence_penalties,
                    metadata.frequency_penalties,
                )
            sampled = self.sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(
            raw_logprobs, sampled, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled, token_ids, logprobs, ranks)
    # --8<-- [end:sampler-forward]

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows: argmax. Random rows: temperature, min-p, top-k/top-p, then a draw."""
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy

        logits = apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        random = sample_exponential_race(probs, metadata.generators)

        if greedy is None:
            return random
        return torch.where(metadata.temperature < _GREEDY_TEMPERATURE, greedy, random)


# --8<-- [start:one-pass-sampling]
def one_pass_sampling_applies(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    """Can this step's draw be the one-pass Gumbel-max kernel instead of the PyTorch steps?

    On a GPU, when the batch asks for temperature and nothing else: no top-k, top-p or min-p
    (they need the sorted or normalized row), no penalties or min_tokens (they rewrite the
    logits first), no seeded row (its noise must come from its own generator, whatever the
    batch); and the batch is small enough for the kernel's 32-bit noise counters (some
    50,000 rows). An all-greedy batch takes the same kernel with no noise: its argmax, read
    in the logits' own dtype, where the PyTorch path makes a float32 copy first (on an H100,
    one row of Qwen3's vocabulary 8.9 µs against 16.5, 256 rows 43.8 against 204: chapter 06).
    """
    if not logits.is_cuda:
        return False
    from minivllm.kernels.sampling import fits_one_launch  # only on a GPU: see Sampler.forward

    return (
        fits_one_launch(*logits.shape)
        and metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
        and metadata.no_penalties and not metadata.min_tokens_blocked
        and not metadata.generators
    )


def draw_seed() -> int:
    """A fresh key for the kernel's noise, from torch's default generator (so
    `torch.manual_seed` makes a run repeatable, as it does for the PyTorch path)."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
# --8<-- [end:one-pass-sampling]


# --8<-- [start:compute-logprobs]
def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax in float32: bf16 would round away the small differences between tokens."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)
# --8<-- [end:compute-logprobs]


# --8<-- [start:apply-min-tokens]
def apply_min_tokens(logits: torch.Tensor, blocked: dict[int, set[int]]) -> torch.Tensor:
    """Forbid each row's stop tokens until the request has generated `min_tokens` tokens."""
    if not blocked:
        return logits
    rows = [row for row, token_ids in blocked.items() for _ in token_ids]
    cols = [token_id for token_ids in blocked.values() for token_id in token_ids]
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits
# --8<-- [end:apply-min-tokens]


# --8<-- [start:apply-penalties]
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> torch.Tensor:
    """Discourage tokens that already appeared.

    - repetition (HF/vLLM, CTRL paper): a token seen in the prompt *or* the output has its
      logit pushed towards "less likely": divided by the penalty when positive, multiplied
      when negative (dividing a negative logit would make it *more* likely).
    - frequency (OpenAI): subtract penalty * (times the token appears in the output).
    - presence (OpenAI): subtract penalty once if the token appears in the output at all.
    The OpenAI pair looks at generated tokens only, so a prompt can be quoted freely.
    """
    vocab_size = logits.shape[-1]
    output_counts = count_tokens(output_token_ids, vocab_size, logits.device)
    in_output = output_counts > 0
    seen = in_output | (count_tokens(prompt_token_ids, vocab_size, logits.device) > 0)

    repetition = repetition_penalties.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalties.unsqueeze(-1) * output_counts
    return logits - presence_penalties.unsqueeze(-1) * in_output


def count_tokens(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] counts of each token id per row, with one batched scatter_add.

    Rows have different lengths, so they are padded with the id `vocab_size`: its counts land
    in an extra column that is dropped at the end.
    """
    longest = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor(
        [ids + [vocab_size] * (longest - len(ids)) for ids in token_ids],
        dtype=torch.int64,
        device=device,
    ).reshape(len(token_ids), longest)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]
# --8<-- [end:apply-penalties]


# --8<-- [start:apply-temperature]
def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T): T < 1 sharpens the distribution, T > 1 flattens it.

    Greedy rows (T = 0) in a mixed batch are divided by 1 instead; their result is discarded.
    """
    safe = torch.where(temperature < _GREEDY_TEMPERATURE, 1.0, temperature)
    return logits / safe.unsqueeze(-1)
# --8<-- [end:apply-temperature]


# --8<-- [start:apply-min-p]
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's probability.

    The cut scales with the model's confidence: a peaked distribution keeps few tokens, a
    flat one keeps many. min_p = 0 keeps everything.
    """
    probs = logits.softmax(dim=-1)
    top_prob = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < min_p.unsqueeze(-1) * top_prob, float("-inf"))
# --8<-- [end:apply-min-p]


# --8<-- [start:apply-top-k-top-p]
def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest head of those whose mass reaches p.

    Both are computed on one descending sort of each row and applied as a *threshold*: every
    token whose logit is below the last kept token's logit is masked. So ties at the boundary
    are all kept (with logits [3, 2, 2, 1] and k = 2, three tokens survive); the result never
    depends on token ids. top_k = 0 and top_p = 1 switch a row off.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values

    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        kth_largest = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))

    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)  # renormalized over the top-k survivors
        # Mass of the tokens strictly above each position; position j is needed while the
        # tokens above it hold less than p. (A cumsum of non-negatives never decreases, so
        # the kept positions form a prefix of the sorted row.)
        mass_above = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))
        num_kept = (mass_above < top_p.unsqueeze(-1)).sum(dim=-1).clamp(min=1)
        # p = 1 means "off"; rounding in the cumsum must not drop the tail of those rows.
        num_kept = torch.where(top_p >= 1.0, vocab_size, num_kept)
        boundary = sorted_logits.gather(-1, (num_kept - 1).unsqueeze(-1))
        logits = logits.masked_fill(logits < boundary, float("-inf"))
    return logits
# --8<-- [end:apply-top-k-top-p]


# --8<-- [start:sample-exponential-race]
def sample_exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """Draw one token per row from `probs` with argmax(probs / E), E_i ~ Exp(1) i.i.d.

    Why it is exact: E_i / p_i is exponential with rate p_i, and the smallest of independent
    exponentials is number i with probability p_i / sum(p) -- so the largest p_i / E_i wins
    with probability p_i. Unlike torch.multinomial it needs no cumsum and no sync, and it lets
    each row choose where its noise comes from: a seeded row draws from its request's own
    generator, so its tokens do not depend on which other requests share the batch; all other
    rows share one batched draw from the default generator.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would give 0/0 = nan for masked tokens; it is a ~2^-24 event.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
# --8<-- [end:sample-exponential-race]


# --8<-- [start:gather-logprobs]
def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled token's logprob and rank, plus the top-`num_logprobs` tokens of each row.

    Rank = 1 + the number of tokens with a strictly greater logprob, so tied tokens share a
    rank and the argmax always has rank 1.
    """
    sampled_logprob = logprobs.gather(-1, sampled.unsqueeze(-1))
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
    token_ids = torch.cat([sampled.unsqueeze(-1), top_ids], dim=-1)
    return token_ids, torch.cat([sampled_logprob, top_logprobs], dim=-1), ranks
# --8<-- [end:gather-logprobs]

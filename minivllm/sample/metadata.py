"""`SamplingMetadata`: one step's sampling parameters, batched into tensors.

Chapter 03 (scheduler) explains where a step's batch comes from; chapter 06 explains how the
sampler turns that batch's logits into tokens. Between the two sits this module: the model
runner collects the `SamplingParams` of the B requests in the step and turns them into a few
[B] tensors, so the sampler can treat every row with one vectorized operation instead of a
Python loop per request.

A knob that no row in the batch uses is stored as `None` (not as a tensor of "off" values).
The sampler then skips that transformation entirely: most batches use only temperature, and
a sort over the vocabulary for top-p that changes nothing would be wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import SamplingParams, SamplingType


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step of B rows (row i = i-th request in the batch).

    `temperature` keeps the requested values, 0 for greedy rows; the sampler reads greedy rows
    from it (temperature < 1e-5, the same cut-off as `SamplingParams`).
    """

    temperature: torch.Tensor  # [B] float32
    all_greedy: bool  # every row is greedy: skip the random path
    all_random: bool  # no row is greedy: skip the argmax path

    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off; None when no row uses top-p
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off; None when no row uses min-p

    # Row index -> that request's own generator. Only seeded random rows are here; every other
    # random row draws its noise from torch's default generator.
    generators: dict[int, torch.Generator]

    # The largest `logprobs` asked for in the batch; None when no row wants logprobs.
    max_num_logprobs: int | None

    # Penalties: all three None when no row uses any penalty (1.0 / 0.0 / 0.0 = off).
    repetition_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: list[list[int]]  # per row; read only when penalties are on
    output_token_ids: list[list[int]]  # per row, the tokens generated so far

    # min_tokens: row index -> token ids that must not be sampled yet (the request's stop
    # tokens, while it has fewer than min_tokens outputs). Rows with nothing to block are absent.
    min_tokens_blocked: dict[int, set[int]] = field(default_factory=dict)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    device: torch.device,
) -> SamplingMetadata:
    """Batch the sampling parameters of one step's requests (one entry per row, in row order).

    `generators[i]` is request i's own `torch.Generator` (made by the engine from its seed) or
    None; it is used only if the row samples randomly.
    """
    num_rows = len(params)
    if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows):
        raise ValueError(
            "build_sampling_metadata needs one prompt, one output list and one generator per "
            f"row: got {num_rows} params, {len(prompt_token_ids)} prompts, "
            f"{len(output_token_ids)} outputs, {len(generators)} generators"
        )

    def row_tensor(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        if device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=device)
        # From pinned memory without blocking: `torch.tensor(..., device="cuda")` would wait
        # for the forward pass already queued on the GPU, and the host would idle meanwhile.
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

    is_greedy = [p.sampling_type == SamplingType.GREEDY for p in params]

    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    uses_penalties = any(r != 1.0 for r in rep) or any(pres) or any(freq)

    asked = [p.logprobs for p in params if p.logprobs is not None]

    blocked: dict[int, set[int]] = {}
    for row, (p, output) in enumerate(zip(params, output_token_ids)):
        # The stop tokens may not end the request before it has min_tokens outputs.
        if len(output) < p.min_tokens and p.all_stop_token_ids:
            blocked[row] = set(p.all_stop_token_ids)

    return SamplingMetadata(
        temperature=row_tensor([p.temperature for p in params], torch.float32),
        all_greedy=all(is_greedy),
        all_random=not any(is_greedy),
        top_k=row_tensor(top_k, torch.int64) if any(top_k) else None,
        top_p=row_tensor(top_p, torch.float32) if any(v < 1.0 for v in top_p) else None,
        min_p=row_tensor(min_p, torch.float32) if any(min_p) else None,
        generators={
            row: gen
            for row, gen in enumerate(generators)
            if gen is not None and not is_greedy[row]
        },
        max_num_logprobs=max(asked) if asked else None,
        repetition_penalties=row_tensor(rep, torch.float32) if uses_penalties else None,
        presence_penalties=row_tensor(pres, torch.float32) if uses_penalties else None,
        frequency_penalties=row_tensor(freq, torch.float32) if uses_penalties else None,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        min_tokens_blocked=blocked,
    )
